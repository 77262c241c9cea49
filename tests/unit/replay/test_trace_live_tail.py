"""Live replay of a trace whose `hash_ids` cover less than `input_length` (or nothing): the
prompt sent is `input_length` tokens, its uncovered tail text of its own.

The prompt was cut to the ids' length: `hash_ids: []` sent an empty prompt, which vLLM (and
the simulator) refuse with a 400, and [5] for 3,000 tokens sent 512; the live figures then
disagreed with the offline ones, which count every token of `input_length`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from gateway.cli import main as kvgate
from loadtest.replay.text import render_prompt
from routing.tokens import CHARS_PER_TOKEN
from tests.support.gateway import metric_values
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ROWS = [(1000, []), (3000, [5]), (600, [5, 6]), (1024, [5, 6, 7])]  # input_length, hash_ids


def test_uncovered_tokens_are_rendered_and_shared_with_no_one() -> None:
    assert len(render_prompt((), 512, 100)) == 100 * CHARS_PER_TOKEN
    one, two = render_prompt((5,), 512, 3000), render_prompt((5,), 512, 3000)
    assert len(one) == 3000 * CHARS_PER_TOKEN
    block = 512 * CHARS_PER_TOKEN
    assert one[:block] == two[:block] == render_prompt((5, 6), 512, 600)[:block]
    assert one[block:block + 16] != two[block:block + 16]  # no token of the tail shared


def test_a_live_replay_sends_every_prompt_token(sim_factory: SimFactory, tmp_path: Path) -> None:
    _, sim = sim_factory("--time-scale", "50")
    trace = tmp_path / "short.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": n,
                                         "output_length": 2, "hash_ids": ids}) + "\n"
                             for i, (n, ids) in enumerate(ROWS)))
    out = tmp_path / "s.json"
    assert kvgate(["replay", str(trace), "--target", sim, "--replica", sim, "--time-scale", "50",
                   "--json", str(out)]) == 0
    (summary,) = json.loads(out.read_text())
    assert (summary["requests"], summary["failed"]) == (len(ROWS), 0), summary["errors"]
    queried = sum(metric_values(sim, "vllm:prefix_cache_queries_total").values())
    assert queried == sum(n for n, _ in ROWS)
