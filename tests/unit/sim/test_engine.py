"""The engine's scheduler, cost model, preemption and fast-forward (table-driven where it fits)."""

from __future__ import annotations

import math
import random

import pytest

from loadtest.sim.costmodel import CostModel
from loadtest.sim.engine import Engine
from loadtest.sim.spec import EngineConfig, RequestOutput, RequestSpec

COST = CostModel(step_overhead_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002,
                 kv_read_token_s=1e-6)


def _engine(**kw: object) -> Engine:
    args: dict[str, object] = {"cost": COST, "num_gpu_blocks": 1000, "block_size": 16,
                               "max_model_len": 4096}
    args.update(kw)
    return Engine(EngineConfig(**args))  # type: ignore[arg-type]


def _spec(rid: str, prompt: int, out: int, prefix: str = "p", **kw: object) -> RequestSpec:
    hashes = tuple(hash((prefix, i)) for i in range(prompt // 16))
    return RequestSpec(rid, hashes, prompt, out, **kw)  # type: ignore[arg-type]


def _run(engine: Engine, until: float = math.inf) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for out in engine.advance(until):
        done[out.request_id] = out
    return done


def test_single_request_follows_the_cost_model() -> None:
    e = _engine()
    e.add_request(_spec("a", 160, 4), 0.0)
    out = _run(e)["a"]
    prefill = COST.step_time(160, 0, 160)
    decodes = sum(COST.step_time(0, 1, 161 + i) for i in range(3))
    assert out.first_token_time == pytest.approx(prefill)
    assert out.time == pytest.approx(prefill + decodes)
    assert (out.new_tokens, out.finish_reason) == (4, "length")


@pytest.mark.parametrize(
    ("max_tokens", "eos_after", "ignore_eos", "tokens", "reason"),
    [
        (10, None, False, 10, "length"),
        (10, 4, False, 4, "stop"),
        (10, 10, False, 10, "stop"),
        (10, 12, False, 10, "length"),
        (10, 4, True, 10, "length"),
    ],
)
def test_finish_reasons(max_tokens: int, eos_after: int | None, ignore_eos: bool, tokens: int,
                        reason: str) -> None:
    e = _engine()
    e.add_request(_spec("a", 32, max_tokens, eos_after=eos_after, ignore_eos=ignore_eos), 0.0)
    out = _run(e)["a"]
    assert (out.num_output_tokens, out.finish_reason) == (tokens, reason)
    assert e.stats.finished[reason] == 1


@pytest.mark.parametrize(
    ("first", "second", "cached"),
    [
        ((160, "p"), (160, "p"), 144),  # identical 10 blocks: the last token is recomputed
        ((160, "p"), (320, "p"), 160),  # extends a cached prefix
        ((160, "p"), (160, "q"), 0),  # different chain (e.g. another salt)
        ((15, "p"), (15, "p"), 0),  # below one block: nothing cacheable
    ],
)
def test_prefix_hits(first: tuple[int, str], second: tuple[int, str], cached: int) -> None:
    e = _engine()
    e.add_request(_spec("a", first[0], 2, first[1]), 0.0)
    _run(e)
    e.add_request(_spec("b", second[0], 2, second[1]), e.now)
    out = _run(e)["b"]
    assert out.cached_tokens == cached
    assert e.stats.prefix_cache_hits == cached
    assert e.stats.prefix_cache_queries == first[0] + second[0]


def test_cached_prefix_shortens_ttft() -> None:
    e = _engine()
    e.add_request(_spec("a", 1600, 1), 0.0)
    cold = _run(e)["a"].first_token_time
    start = e.now
    e.add_request(_spec("b", 1600, 1), start)
    warm = _run(e)["b"].first_token_time
    assert cold is not None and warm is not None
    assert warm - start < cold / 5


def test_chunked_prefill_respects_token_budget() -> None:
    e = _engine(max_num_batched_tokens=512)
    e.add_request(_spec("a", 1200, 2), 0.0)
    e.step()
    e.step()
    assert e.stats.prefill_tokens_computed == 1024
    outs = e.step()
    assert outs and outs[0].first_token_time is not None  # third chunk finishes the prefill


@pytest.mark.parametrize(("max_num_seqs", "running", "waiting"), [(2, 2, 1), (3, 3, 0)])
def test_max_num_seqs(max_num_seqs: int, running: int, waiting: int) -> None:
    e = _engine(max_num_seqs=max_num_seqs)
    for i in range(3):
        e.add_request(_spec(str(i), 32, 50, prefix=str(i)), 0.0)
    e.step()
    assert (e.num_running, e.num_waiting) == (running, waiting)


def test_request_waits_for_kv_blocks() -> None:
    e = _engine(num_gpu_blocks=21, max_model_len=320)  # 20 usable blocks
    e.add_request(_spec("a", 240, 50, "a"), 0.0)  # 15 blocks + decode growth
    e.add_request(_spec("b", 160, 5, "b"), 0.0)  # 10 blocks: does not fit next to a
    e.step()
    assert (e.num_running, e.num_waiting) == (1, 1)
    done = _run(e)
    assert done["b"].first_token_time is not None
    assert done["b"].first_token_time >= done["a"].time


def test_newest_running_request_is_preempted_and_recomputed() -> None:
    e = _engine(num_gpu_blocks=13, max_model_len=192)  # 12 usable blocks
    e.add_request(_spec("a", 64, 120, "a"), 0.0)  # grows to 12 blocks
    e.add_request(_spec("b", 64, 120, "b"), 0.0)
    done = _run(e)
    assert e.stats.preemptions >= 1
    assert done["b"].num_preemptions >= 1 and done["a"].num_preemptions == 0
    assert {o.finish_reason for o in done.values()} == {"length"}
    assert done["a"].num_output_tokens == done["b"].num_output_tokens == 120
    assert e.kv_usage == 0.0
    # vLLM counts a preempted request's return apart: the prefix-cache counters hold each
    # request once, its first admission (b's recomputed blocks are no cache hits)
    assert e.stats.prefix_cache_queries == 128 and e.stats.prefix_cache_hits == 0


def test_abort_frees_blocks_and_counts() -> None:
    e = _engine()
    e.add_request(_spec("a", 320, 100), 0.0)
    e.add_request(_spec("w", 32, 10, "w"), 0.0)
    e.step()
    assert e.kv_usage > 0
    assert e.abort("a") and e.abort("w")
    assert not e.abort("a")
    assert e.kv_usage == 0.0 and not e.busy
    assert e.stats.finished["abort"] == 2


def test_priority_policy_admits_lower_value_first() -> None:
    e = _engine(scheduling_policy="priority", max_num_seqs=1)
    e.add_request(_spec("low", 32, 3, "l", priority=10), 0.0)
    e.add_request(_spec("high", 32, 3, "h", priority=0), 0.0)
    done = _run(e)
    assert done["high"].time < done["low"].time


def test_config_rejects_max_model_len_beyond_capacity() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        _engine(num_gpu_blocks=10, max_model_len=4096)


def _workload(seed: int) -> list[tuple[float, RequestSpec]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(60):
        t += rng.expovariate(4.0)
        prompt = rng.randrange(20, 900)
        spec = _spec(str(i), prompt, rng.randrange(1, 300), prefix=str(rng.randrange(5)),
                     eos_after=rng.choice([None, rng.randrange(1, 300)]))
        out.append((t, spec))
    return out


def _replay(step_only: bool, seed: int) -> tuple[dict[str, tuple[float, float | None, int]], int]:
    e = _engine(num_gpu_blocks=400, max_model_len=1300, max_num_batched_tokens=512)
    seen: dict[str, tuple[float, float | None, int]] = {}
    first: dict[str, float] = {}

    def collect(outs: list[RequestOutput]) -> None:
        for o in outs:
            if o.first_token_time is not None:
                first[o.request_id] = o.first_token_time
            if o.finish_reason:
                seen[o.request_id] = (o.time, first.get(o.request_id), o.num_output_tokens)

    for t, spec in _workload(seed):
        while step_only and e.busy and e.now < t:
            collect(e.step())
        collect(e.advance(t))
        e.add_request(spec, t)
    while step_only and e.busy:
        collect(e.step())
    collect(e.advance(math.inf))
    return seen, e.stats.preemptions


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fast_forward_matches_step_by_step(seed: int) -> None:
    fast, pre_fast = _replay(False, seed)
    slow, pre_slow = _replay(True, seed)
    assert fast.keys() == slow.keys() and len(fast) == 60
    assert pre_fast == pre_slow
    for rid, (end, first, tokens) in slow.items():
        f_end, f_first, f_tokens = fast[rid]
        assert f_tokens == tokens
        assert f_end == pytest.approx(end, rel=1e-9, abs=1e-9)
        assert f_first == pytest.approx(first, rel=1e-9, abs=1e-9)


def test_fast_forward_is_used_for_long_decodes() -> None:
    e = _engine()
    e.add_request(_spec("a", 32, 1000 - 32), 0.0)
    _run(e)
    assert e.stats.fast_forwarded_steps > 900


# -- prefix blocks are cached when scheduled (vLLM V1's KVCacheManager.allocate_slots) ----------


def test_a_request_admitted_after_another_in_the_same_step_hits_its_blocks() -> None:
    e = _engine()
    e.add_request(_spec("a", 65, 2), 0.0)  # 4 full blocks and the last token
    e.add_request(_spec("b", 65, 2), 0.0)
    e.step()
    assert e.num_running == 2  # both in the first step
    done = _run(e)
    assert done["b"].cached_tokens == 64 and e.stats.prefix_cache_hits == 64
    # the prompt once, then b's last token (V0's rule, a block cached when its step ends,
    # made b compute all 65)
    assert e.stats.prefill_tokens_computed == 65 + 1
    assert done["a"].first_token_time == done["b"].first_token_time


def test_a_chunk_being_computed_is_hit_by_a_request_admitted_behind_it() -> None:
    e = _engine(max_num_batched_tokens=512)
    e.add_request(_spec("a", 800, 2), 0.0)  # 50 blocks: 512 tokens, then 288
    e.step()
    e.add_request(_spec("b", 816, 2), e.now / 2)  # same 50 blocks and one more
    e.step()  # a's second chunk, then b with what is left of the budget
    assert e.num_running == 2 and e.num_waiting == 0
    done = _run(e)
    # all of a's blocks, those of the chunk computed in b's own step too (V0: the first 512)
    assert done["b"].cached_tokens == 800
    assert e.stats.prefill_tokens_computed == 800 + 16
    assert done["a"].first_token_time == done["b"].first_token_time


def _check_blocks(e: Engine) -> None:
    """Every used block is one running request's private block or a cached block it
    references, each reference counted once; every other cached block is evictable."""
    cache, running = e.cache, e._running
    shared = {h for r in running for h in r.cached}
    assert cache.used() == sum(r.private for r in running) + len(shared)
    assert cache.cached_blocks() - len(shared) == cache.available() - cache.empty
    for h in shared:
        assert cache._ref[h] == sum(r.cached.count(h) for r in running)


def test_preempting_a_request_that_shares_blocks_cached_at_schedule_keeps_counts() -> None:
    e = _engine(num_gpu_blocks=13, max_model_len=192)  # 12 usable blocks
    e.add_request(_spec("a", 65, 120), 0.0)  # 5 blocks, grows to 12
    e.add_request(_spec("b", 65, 120), 0.0)  # hits a's 4 in the same step: 1 block more
    e.step()
    assert e.cache.used() == 6
    _check_blocks(e)
    while not e.stats.preemptions:
        e.step()
        _check_blocks(e)
    assert e.num_running == 1  # b, the newest, went back to the queue; a keeps the 4 blocks
    assert [e.cache._ref[h] for h in _spec("a", 65, 1).block_hashes] == [1] * 4
    done = _run(e)
    assert done["b"].num_preemptions >= 1
    assert {o.num_output_tokens for o in done.values()} == {120}
    assert e.kv_usage == 0.0 and e.cache.available() == e.cache.usable
    # counted once, at b's first admission: a's 4 blocks (V0: 0, they were not cached yet)
    assert e.stats.prefix_cache_hits == 64
    assert all(e.cache.contains(h) for h in _spec("a", 65, 1).block_hashes)
