"""KVCache: hits, chaining, salt isolation, LRU eviction, capacity (table-driven)."""

from __future__ import annotations

import pytest

from loadtest.sim.cache import KVCache
from loadtest.sim.prompt import block_hashes


def _hold(cache: KVCache, hashes: list[int]) -> None:
    """A request that computed ``hashes``: allocate private blocks, then register them."""
    assert cache.allocate(len(hashes))
    for h in hashes:
        assert cache.register(h)


@pytest.mark.parametrize(
    ("held", "query", "limit", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], 3, 3),  # full hit
        ([1, 2, 3], [1, 2, 9], 3, 2),  # diverges at block 3
        ([1, 2, 3], [9, 2, 3], 3, 0),  # leading run only: a later match does not count
        ([1, 2, 3], [1, 2, 3], 2, 2),  # capped by the caller's limit
        ([], [1, 2], 2, 0),  # empty cache
    ],
)
def test_match_longest_leading_run(held: list[int], query: list[int], limit: int,
                                   expected: int) -> None:
    cache = KVCache(16)
    _hold(cache, held)
    assert cache.match(query, limit) == expected


@pytest.mark.parametrize(
    ("a", "b", "salt_a", "salt_b", "shared_blocks"),
    [
        (list(range(64)), list(range(64)), None, None, 4),  # same tokens, same chain
        (list(range(64)), list(range(64)), "t1", "t1", 4),  # same salt shares
        (list(range(64)), list(range(64)), "t1", "t2", 0),  # salts isolate every block
        (list(range(64)), list(range(64)), None, "t1", 0),  # salted vs unsalted
        (list(range(64)), [*range(16), 999, *range(17, 64)], None, None, 1),  # chain breaks
    ],
)
def test_chained_hashes_and_salt(a: list[int], b: list[int], salt_a: str | None,
                                 salt_b: str | None, shared_blocks: int) -> None:
    ha, hb = block_hashes(a, 16, salt_a), block_hashes(b, 16, salt_b)
    assert len(ha) == len(hb) == 4
    cache = KVCache(16)
    _hold(cache, list(ha))
    assert cache.match(hb, len(hb)) == shared_blocks


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert block_hashes(list(range(47)), 16) == block_hashes(list(range(32)), 16)


def test_usage_counts_only_referenced_blocks() -> None:
    cache = KVCache(11)  # 10 usable
    _hold(cache, [1, 2, 3, 4])
    assert cache.allocate(2)  # two private blocks
    assert cache.usage() == pytest.approx(0.6)
    cache.release([1, 2, 3, 4], 2)
    assert cache.usage() == 0.0
    assert cache.cached_blocks() == 4  # still cached, evictable
    assert cache.match([1, 2, 3, 4], 4) == 4


@pytest.mark.parametrize(
    ("allocate", "evicted", "survivors"),
    [
        (6, [], [1, 2, 3, 4]),  # empty blocks are used before any eviction
        (7, [4], [1, 2, 3]),  # tail block of the released chain goes first
        (8, [4, 3], [1, 2]),
        (10, [4, 3, 2, 1], []),
    ],
)
def test_lru_eviction_only_when_needed(allocate: int, evicted: list[int],
                                       survivors: list[int]) -> None:
    cache = KVCache(11)  # 10 usable
    _hold(cache, [1, 2, 3, 4])
    cache.release([1, 2, 3, 4], 0)
    assert cache.allocate(allocate)
    assert all(not cache.contains(h) for h in evicted)
    assert all(cache.contains(h) for h in survivors)
    assert cache.evictions == len(evicted)


def test_lru_order_follows_release_time() -> None:
    cache = KVCache(5)  # 4 usable
    _hold(cache, [1, 2])
    _hold(cache, [3, 4])
    cache.release([3, 4], 0)  # released first -> older
    cache.release([1, 2], 0)
    cache.acquire([4])  # a hit takes 4 out of the eviction queue
    assert cache.allocate(2)
    assert not cache.contains(3) and not cache.contains(2)
    assert cache.contains(1) and cache.contains(4)


@pytest.mark.parametrize(("num_blocks", "request_blocks", "ok"), [(9, 8, True), (9, 9, False)])
def test_capacity(num_blocks: int, request_blocks: int, ok: bool) -> None:
    cache = KVCache(num_blocks)  # one block is reserved, like vLLM's null block
    assert cache.allocate(request_blocks) is ok
    assert cache.used() == (request_blocks if ok else 0)


def test_referenced_blocks_are_never_evicted() -> None:
    cache = KVCache(5)
    _hold(cache, [1, 2, 3, 4])
    assert not cache.allocate(1)
    assert cache.match([1, 2, 3, 4], 4) == 4


def test_prefix_caching_off() -> None:
    cache = KVCache(8, enable_prefix_caching=False)
    assert cache.allocate(2)
    assert not cache.register(1)
    assert cache.match([1], 1) == 0
