from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable

import pytest

from routing.index import AffinityIndex


def chain(tag: int, n: int) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


def test_match_is_longest_prefix_per_replica() -> None:
    idx = AffinityIndex(100)
    idx.insert("a", chain(1, 5))
    idx.insert("b", chain(1, 2))
    idx.insert("c", chain(2, 5))
    assert idx.match(chain(1, 5)) == {"a": 5, "b": 2}
    assert idx.match(chain(1, 3)) == {"a": 3, "b": 2}
    assert idx.match(chain(3, 3)) == {}
    assert idx.match([]) == {}
    assert idx.match_one("a", chain(1, 9)) == 5
    assert idx.match_one("zzz", chain(1, 9)) == 0


def test_capacity_bounds_entries_and_evicts_tails_first() -> None:
    idx = AffinityIndex(4)
    idx.insert("a", chain(1, 3))
    idx.insert("a", chain(2, 3))
    assert idx.entries("a") == 4
    # the newest request's whole chain plus the oldest request's head survive
    assert idx.match(chain(2, 3)) == {"a": 3}
    assert idx.match(chain(1, 3)) == {"a": 1}


def test_set_capacity_shrinks() -> None:
    idx = AffinityIndex(100)
    idx.insert("a", chain(1, 50))
    idx.set_capacity("a", 10)
    assert idx.entries("a") == 10
    assert idx.capacity("a") == 10
    assert idx.match(chain(1, 50)) == {"a": 10}


def test_forget_drops_replica_and_reuses_its_slot() -> None:
    idx = AffinityIndex(100)
    idx.insert("a", chain(1, 3))
    idx.insert("b", chain(1, 3))
    idx.forget("a")
    idx.forget("a")  # idempotent
    assert idx.match(chain(1, 3)) == {"b": 3}
    assert idx.holders(chain(1, 1)[0]) == 1
    idx.insert("c", chain(2, 2))  # takes a's slot: must not inherit a's blocks
    assert idx.match(chain(1, 3)) == {"b": 3}
    assert idx.replicas() == ["b", "c"]
    idx.forget("b")
    idx.forget("c")
    assert idx.distinct_blocks() == 0


def test_tail_blocks_spend_capacity_like_the_engine() -> None:
    idx = AffinityIndex(10)
    idx.insert("a", chain(1, 3))
    idx.insert("a", chain(2, 3), tail_blocks=5)  # a long prompt: 8 blocks of cache in all
    assert idx.used("a") == 10
    assert idx.match(chain(1, 3)) == {"a": 2}  # the older prompt lost its tail to make room
    idx.insert("a", chain(2, 3), tail_blocks=2)  # the same chain again: its weight is replaced
    assert idx.used("a") == 7
    idx.insert("a", chain(3, 2), tail_blocks=20)  # more than the capacity: evicted at once
    assert idx.used("a") <= 10
    assert idx.match(chain(3, 2)) == {"a": 1}


def test_tail_weight_leaves_with_its_block() -> None:
    idx = AffinityIndex(100)
    idx.insert("a", chain(1, 4), tail_blocks=30)
    idx.set_capacity("a", 4)  # the weighted tail is the oldest entry: it goes first
    assert (idx.used("a"), idx.entries("a")) == (3, 3)
    assert idx.match(chain(1, 4)) == {"a": 3}



class _Model:
    """The index's rule spelled out one block at a time: per replica an LRU of block ->
    (weight, a peer touched it last); a chain is inserted tail first; the oldest entries go
    while the weights exceed the capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lrus: dict[str, OrderedDict[int, tuple[int, bool]]] = {}

    def insert(self, replica: str, hashes: list[int], tail: int, peer: bool) -> None:
        lru = self.lrus.setdefault(replica, OrderedDict())
        last = len(hashes) - 1
        for i in range(last, -1, -1):
            weight, flag = lru.pop(hashes[i], (1, peer))
            if i == last and tail > 0:
                weight, flag = 1 + tail, peer
            lru[hashes[i]] = (weight, peer if i == 0 else flag)
        while sum(w for w, _ in lru.values()) > self.capacity:
            lru.popitem(last=False)


def _prefix_chain(rng: random.Random, heads: list[list[int]]) -> list[int]:
    """A chain as requests make them: a shared head's prefix, then new blocks."""
    head = rng.choice(heads)
    return head[:rng.randrange(1, 12)] + [rng.getrandbits(20) + 2**21
                                          for _ in range(rng.randrange(4))]


def _any_chain(rng: random.Random, heads: list[list[int]]) -> list[int]:
    """Blocks in any order, repeats included: a held block may follow one not held (what a
    hash collision would do), which `insert`'s one-pass refresh of held blocks cannot take."""
    return [rng.randrange(60) for _ in range(rng.randrange(1, 14))]


@pytest.mark.parametrize("make_chain", [_prefix_chain, _any_chain])
def test_inserts_follow_the_block_by_block_rule(
    make_chain: Callable[[random.Random, list[list[int]]], list[int]],
) -> None:
    """Random chains sharing prefixes (or not), tails, peers' and own inserts, evictions: the
    index's entries (in LRU order), their weights and peer marks, its block owners and its
    matches are those of the rule applied one block at a time."""
    rng = random.Random(5)
    capacity = 40
    idx, model = AffinityIndex(capacity), _Model(capacity)
    heads = [[rng.getrandbits(20) for _ in range(12)] for _ in range(6)]
    for _ in range(3000):
        chain = make_chain(rng, heads)
        replica, tail, peer = rng.choice("abc"), rng.choice([0, 0, 0, 3, 9]), rng.random() < 0.5
        idx.insert(replica, chain, tail, peer)
        model.insert(replica, chain, tail, peer)
        for r, lru in model.lrus.items():
            assert list(idx._replicas[r].blocks) == list(lru)
            assert [idx.peer_touched(r, h) for h in lru] == [f for _, f in lru.values()]
            assert idx.used(r) == sum(w for w, _ in lru.values())
            probe = rng.choice(heads)[:rng.randrange(1, 12)]
            expected = 0
            while expected < len(probe) and probe[expected] in lru:
                expected += 1
            if expected == len(probe):
                expected += lru[probe[-1]][0] - 1
            assert idx.match_one(r, probe) == expected
        assert all(idx.holders(h) == sum(h in lru for lru in model.lrus.values())
                   for lru in model.lrus.values() for h in lru)
        assert idx.distinct_blocks() == len(set().union(*model.lrus.values()))


def test_insert_returns_what_match_one_counted_before() -> None:
    """A peer's route costs one walk: insert tells the blocks held before, as match_one does
    (capped chains with tails, shared heads, evictions at a small capacity)."""
    rnd = random.Random(5)
    index = AffinityIndex(40)
    heads = [[rnd.getrandbits(60) for _ in range(6)] for _ in range(4)]
    for _ in range(3000):
        replica = f"r{rnd.randrange(3)}"
        chain = rnd.choice(heads)[: rnd.randrange(0, 7)] + [
            rnd.getrandbits(60) for _ in range(rnd.randrange(0, 3))]
        tail = rnd.choice((0, 0, 3))
        if rnd.random() < 0.3 and chain:  # the same chain again: held whole, with its tail
            index.insert(replica, chain, tail)
        before = index.match_one(replica, chain)
        assert index.insert(replica, chain, tail, peer=True) == before
