from __future__ import annotations

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
