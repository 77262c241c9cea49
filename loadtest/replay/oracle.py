"""`oracle` (offline replay only, never offered for serving): the yardstick placement.

It reads what no router can: every engine's true cache contents and queue. For each candidate
it computes the request's time to first token from that truth -- the prompt tokens the cache
will hold when the request is scheduled (what it holds now, plus the prompt blocks of the
requests running or queued ahead: the engine caches a prompt's blocks when it schedules them,
as vLLM V1 does), the prefill work really queued ahead (each queued prompt less what the ones
ahead of it leave cached; chunked at the engine's token budget, each step also carrying the
decoding batch), the step in progress -- with the engine's own cost model, and picks the
least, under the same bounded-load rule as kvgate's policies. So it is a
greedy, exactly-informed TTFT minimiser: what placement could reach with perfect knowledge of
the present (not of the future; the pooled LRU reference is the bound on hits).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from loadtest.sim.engine import Engine
from loadtest.sim.spec import RequestSpec
from routing.load import LoadBound, mix
from routing.policies.base import PickContext, RouterState, decide
from routing.types import Candidate, Decision

__all__ = ["Oracle", "Truth", "true_ttft"]


@dataclass(slots=True)
class Truth:
    """The engines by replica id, and the request being routed (its engine-level hashes)."""

    engines: Mapping[str, Engine]
    request: RequestSpec | None = None


def true_ttft(engine: Engine, spec: RequestSpec, now: float) -> tuple[float, int]:
    """(predicted TTFT in s, cached prompt tokens when scheduled) of ``spec`` queued on
    ``engine`` at ``now``."""
    cfg = engine.config
    cost = cfg.cost
    cached, ahead, decoding, context = engine.backlog(spec)
    work = ahead + spec.prompt_tokens - cached
    per_step = max(1, cfg.max_num_batched_tokens - decoding)
    steps = max(1, math.ceil(work / per_step))
    step = cost.step_overhead_s + cost.decode_seq_s * decoding + cost.kv_read_token_s * context
    busy = max(0.0, engine.now - now)  # the step in progress ends first
    return busy + steps * step + cost.prefill_token_s * work, cached


class Oracle:
    name = "oracle"

    def __init__(self, state: RouterState, truth: Truth) -> None:
        self._state = state
        self._truth = truth

    def choose(self, ctx: PickContext) -> Decision:
        spec = self._truth.request
        assert spec is not None, "the replay sets the request before each pick"
        cfg, key, hashes = self._state.config, ctx.tie_key, self._state.replica_hashes
        bound = LoadBound(ctx.views, cfg.load_factor, cfg.load_slack)
        rows = []
        for v in ctx.views:
            ttft, cached = true_ttft(self._truth.engines[v.id], spec, ctx.now)
            rows.append((not bound.admits(v), ttft, mix(key, hashes[v.id]), v.id, cached))
        rows.sort()
        ranked: tuple[Candidate, ...] = ()
        if ctx.explain:
            ranked = tuple(
                Candidate(rid, t, {"cached_tokens": float(c), "admitted": float(not refused)})
                for refused, t, _, rid, c in rows
            )
        return decide([r[3] for r in rows], "oracle", ranked)
