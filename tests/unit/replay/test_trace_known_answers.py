"""Small traces whose figures are computed by hand, replayed through `kvgate replay` as a user
would: every policy's hit rate and the pooled reference must be those numbers.

One replica of 1,072 KV tokens (67 blocks of 16; the engine keeps one back) and 512-token
trace blocks (32 cache blocks each): the pooled LRU holds two trace blocks and a bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main as kvgate

SMALL = ("--replicas", "1", "--kv-tokens", "1072")


Summary = dict[str, object]


def _replay(tmp_path: Path, rows: list[tuple[int, list[int]]], *fleet: str) -> list[Summary]:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": n,
                                         "output_length": 4, "hash_ids": ids}) + "\n"
                             for i, (n, ids) in enumerate(rows)))
    out = tmp_path / "s.json"
    assert kvgate(["replay", str(trace), "--offline", "--policy", "all", *fleet,
                   "--json", str(out)]) == 0
    summaries: list[Summary] = json.loads(out.read_text())
    assert len(summaries) == 7 and all(s["requests"] == len(rows) for s in summaries)
    return summaries


def test_one_shared_prefix(tmp_path: Path) -> None:
    """Ten requests [0, own]: all but the first hit block 0, 9 x 512 of 10 x 1024 tokens; on
    two replicas a policy that spreads them misses block 0 once more (8 x 512)."""
    rows = [(1024, [0, 100 + i]) for i in range(10)]
    for s in _replay(tmp_path, rows, "--replicas", "2", "--kv-tokens", "65536"):
        assert s["pooled_reference_hit_rate"] == 0.45
        assert s["hit_rate"] in (0.45, 0.4), s["policy"]


def test_nothing_shared(tmp_path: Path) -> None:
    for s in _replay(tmp_path, [(1024, [2 * i, 2 * i + 1]) for i in range(10)], *SMALL):
        assert s["hit_rate"] == s["pooled_reference_hit_rate"] == 0.0


def test_lru_by_hand(tmp_path: Path) -> None:
    """A A B A [1,5]: the 2nd A hits 1,024 tokens; B evicts A; the 3rd A misses and evicts
    B; [1,5] hits block 1 (512): 1,536 of 5,120 tokens."""
    rows = [(1024, [1, 2]), (1024, [1, 2]), (1024, [3, 4]), (1024, [1, 2]), (1024, [1, 5])]
    for s in _replay(tmp_path, rows, *SMALL):
        assert s["hit_rate"] == s["pooled_reference_hit_rate"] == 0.3, s["policy"]


@pytest.mark.parametrize("tail", [[1], [1, 9]])
def test_an_id_reused_after_another_prefix_is_another_block(
    tail: list[int], tmp_path: Path
) -> None:
    """[1], then [7, 1] (block 1 after block 7: other tokens before it, another KV block),
    then [1] again. The pooled reference keyed blocks by id alone: [7, 1] refreshed [1]
    instead of evicting it, and the last request hit 512 tokens (reference 0.25) where every
    replica missed. Chained as the engine's hashes are, [7, 1] evicts [1]: no hit."""
    rows = [(512, [1]), (1024, [7, 1]), (512 * len(tail), tail)]
    for s in _replay(tmp_path, rows, *SMALL):
        assert s["pooled_reference_hit_rate"] == 0.0, s["policy"]
        assert float(str(s["hit_rate"])) < 0.01  # a 16-token block of [1] may survive
