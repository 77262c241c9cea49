"""The oracle yardstick: true TTFT from the engines' state, under the same bounded load."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace as dc_replace

import pytest

from loadtest.replay.oracle import Oracle, Truth, true_ttft
from loadtest.sim.costmodel import get_preset
from loadtest.sim.engine import Engine
from loadtest.sim.spec import EngineConfig, RequestSpec
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

COST = get_preset("h100-8b-fp8").cost


def _engine() -> Engine:
    return Engine(EngineConfig(cost=COST, num_gpu_blocks=4_096, max_model_len=32_768))


def _spec(rid: str, tokens: int, first: int = 0) -> RequestSpec:
    return RequestSpec(rid, tuple(range(first, first + tokens // 16)), tokens, 4)


@pytest.mark.parametrize("tokens", [100, 3_000, 20_000])
def test_true_ttft_of_an_idle_engine_is_its_prefill(tokens: int) -> None:
    spec = _spec("a", tokens)
    predicted, cached = true_ttft(_engine(), spec, 0.0)
    engine = _engine()
    engine.add_request(spec, 0.0)
    first = next(o.first_token_time for o in engine.advance(60.0) if o.first_token_time)
    assert cached == 0
    assert predicted == pytest.approx(first, rel=0.05)


def test_true_ttft_counts_the_cache_and_the_queue() -> None:
    engine = _engine()
    engine.add_request(_spec("old", 8_000), 0.0)
    engine.advance(10.0)  # done: its blocks are cached
    hit, cached = true_ttft(engine, _spec("new", 8_000), 10.0)
    assert cached == 8_000 - 16  # all full blocks but the one holding the last token
    engine.add_request(_spec("busy", 16_000, first=10_000), 10.0)
    queued, _ = true_ttft(engine, _spec("other", 4_000, first=20_000), 10.0)
    alone, _ = true_ttft(_engine(), _spec("other", 4_000, first=20_000), 10.0)
    assert hit < alone < queued


def test_the_oracle_picks_the_least_true_ttft_within_the_bound() -> None:
    engines = {f"r{i}": _engine() for i in range(4)}
    engines["r1"].add_request(_spec("old", 8_000), 0.0)
    engines["r1"].advance(10.0)
    truth = Truth(engines, _spec("new", 8_000))
    router = Router(RouterConfig(), policy=lambda state: Oracle(state, truth))
    f = RequestFeatures("m", (), 8_000, prefix_key=7)
    idle = [ReplicaView(id=rid, pool="p") for rid in engines]
    assert router.pick(f, idle, 10.0).replica == "r1"  # it holds the prompt
    hot = [ReplicaView(id=rid, pool="p", inflight=20 if rid == "r1" else 0) for rid in engines]
    d = router.pick(f, hot, 10.0)  # ...but is over the bound (2 x 21 / 4 + 4 < 20 + 1)
    assert d.replica != "r1" and d.fallbacks[-1] == "r1"


def _priority_engine() -> Engine:
    return Engine(EngineConfig(cost=COST, num_gpu_blocks=4_096, max_model_len=32_768,
                               scheduling_policy="priority"))


# (engine, requests already there: (id, prompt tokens, first block, priority) arriving 0.5 ms
# apart from t = 0, the new one routed 1 ms after the last)
QUEUES = [
    ("idle, one short prompt ahead", _engine, [("a", 4_000, 0, 0)], ("b", 4_000, 0, 0)),
    ("idle, a chunked prompt ahead", _engine, [("a", 20_000, 0, 0)], ("b", 20_000, 0, 0)),
    ("busy, the same prompt queued", _engine,
     [("x", 30_000, 100_000, 0), ("a", 4_000, 0, 0)], ("b", 4_000, 0, 0)),
    ("busy, the same long prompt queued", _engine,
     [("x", 30_000, 100_000, 0), ("a", 20_000, 0, 0)], ("b", 20_000, 0, 0)),
    ("busy, two queued share a prompt", _engine,
     [("x", 30_000, 100_000, 0), ("a", 6_000, 0, 0), ("a2", 6_000, 0, 0)],
     ("c", 3_000, 50_000, 0)),
    ("priority: a queued prompt behind the new one", _priority_engine,
     [("x", 30_000, 100_000, 0), ("a", 6_000, 0, 5)], ("b", 6_000, 0, 1)),
]


@pytest.mark.parametrize(("engine", "ahead", "new"), [q[1:] for q in QUEUES],
                         ids=[q[0] for q in QUEUES])
def test_true_ttft_is_what_the_engine_gives_a_request_queued_behind_others(
    engine: Callable[[], Engine], ahead: list[tuple[str, int, int, int]],
    new: tuple[str, int, int, int],
) -> None:
    """vLLM V1 caches a prompt's blocks when it is scheduled: a request scheduled after the
    ones queued or prefilling ahead of it hits their blocks, and each queued one behind
    another with its prompt computes only its own suffix."""
    e = engine()
    for i, (rid, tokens, first, prio) in enumerate(ahead):
        e.advance(i * 0.0005)
        e.add_request(dc_replace(_spec(rid, tokens, first), priority=prio), i * 0.0005)
    now = (len(ahead) - 1) * 0.0005 + 0.001
    e.advance(now)
    rid, tokens, first, prio = new
    spec = dc_replace(_spec(rid, tokens, first), priority=prio)
    predicted, cached = true_ttft(e, spec, now)
    e.add_request(spec, now)
    out = next(o for o in e.advance(60.0) if o.request_id == rid)
    assert out.first_token_time is not None
    assert cached == out.cached_tokens
    assert predicted == pytest.approx(out.first_token_time - now, rel=0.01)



def test_the_backlog_walks_a_queue_once_per_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle asks every engine at every pick; each answer walked the engine's whole
    queue, so an overloaded replay (queues of hundreds) took time quadratic in the trace
    (Mooncake sample 10x overlapped, the oracle's first 1,200 requests: 30 s of CPU, 8 s
    after). The queue's part is now computed once per change of the engine."""
    warm = _engine()
    for i in range(40):
        warm.add_request(_spec(f"q{i}", 2_000, first=1_000 * i), 0.0)
    walks = 0
    hits = Engine._hits

    def counted(self: Engine, *args: object) -> int:
        nonlocal walks
        walks += 1
        return hits(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "_hits", counted)
    for spec in ASKED:
        warm.backlog(spec)
    assert walks == 40 + len(ASKED)  # was len(ASKED) x 41


ASKED = [_spec(f"n{i}", 3_000, first=100_000 + 1_000 * (i % 3)) for i in range(6)]
CHANGES: list[Callable[[Engine], object]] = [
    lambda e: e.add_request(_spec("x", 6_000, first=100_000), 0.0),
    lambda e: e.advance(0.2),  # steps: chunks computed, blocks cached
    lambda e: e.abort("q39"),
    lambda e: e.advance(1.5),
    lambda e: e.advance(60.0),  # idle: everything cached
]


def test_the_backlog_after_each_change_is_the_first_answer() -> None:
    """An engine asked before every change answers as one asked only after it."""
    def built(changes: int) -> Engine:
        e = _engine()
        for i in range(40):
            e.add_request(_spec(f"q{i}", 2_000, first=1_000 * i), 0.0)
        for change in CHANGES[:changes]:
            change(e)
        return e

    warm = built(0)
    for k in range(len(CHANGES) + 1):
        if k:
            CHANGES[k - 1](warm)
        assert [warm.backlog(s) for s in ASKED] == [built(k).backlog(s) for s in ASKED], k
