"""`cache_aware` (default): send the request where its estimated time to first token is lowest.

For each healthy candidate r (all terms in prompt tokens unless noted):

    queued_r   = kvgate's own pending uncached prefill work on r (capped by the gateway's
                 in-flight prompt tokens) + requests the scrape shows waiting beyond kvgate's
                 own x the mean request size (only when the scrape is fresh)
    decode_r   = requests decoding on r x decode_weight_tokens (chunked prefill shares steps)
    uncached_r = prompt tokens - tokens of r's predicted prefix match (affinity index)
    ttft_r     = (queued_r + decode_r + uncached_r) / rate_r  +  kv_penalty_r      [seconds]
    kv_penalty = kv_penalty_s x ((kv_usage - kv_knee) / (1 - kv_knee))^2  above the knee

``rate_r`` is r's learned prefill rate (`routing.learning.PrefillRates`). The minimum wins
among the replicas the bounded-load rule admits; costs are compared in ``tie_quantum_s`` steps
and ties go to a stable hash of (prompt, replica), so identical requests spread by a fixed
per-prompt order, never by the order views arrive in.
"""

from __future__ import annotations

from routing.load import LoadBound, fresh, mix
from routing.policies.base import PickContext, RouterState, decide
from routing.types import Candidate, Decision, ReplicaView

__all__ = ["CacheAware"]

# per candidate: (rank key, admitted, view, matched blocks, queued, decode, uncached, rate, kv,
# cost in seconds)
_Row = tuple[tuple[int, int], bool, ReplicaView, int, float, float, float, float, float, float]


class CacheAware:
    name = "cache_aware"

    def __init__(self, state: RouterState) -> None:
        self._state = state

    def _queued(self, v: ReplicaView) -> tuple[float, float]:
        """(queued prefill tokens, decode token-equivalents) on ``v``."""
        st, cfg = self._state, self._state.config
        # our predicted uncached work, capped by the gateway's raw count; the gateway's count
        # alone when we have no record (requests routed before a restart, by another Router)
        own = st.pending.total(v.id) if v.inflight > 0 else 0.0
        gateway = float(v.inflight_prefill_tokens)
        if gateway > 0:
            own = min(own, gateway) if st.pending.count(v.id) else gateway
        own_reqs = v.inflight_prefill or st.pending.count(v.id)
        decoding = float(max(0, v.inflight - own_reqs))
        if fresh(v, cfg.stale_after_s):
            if v.waiting is not None and v.waiting > own_reqs:
                own += (v.waiting - own_reqs) * st.pending.mean_request_tokens
            if v.running is not None:
                decoding = max(decoding, v.running)
        return own, decoding * cfg.decode_weight_tokens

    def _kv_penalty(self, v: ReplicaView) -> tuple[float, float]:
        cfg = self._state.config
        if v.kv_usage is None or not fresh(v, cfg.stale_after_s) or v.kv_usage <= cfg.kv_knee:
            return 0.0, v.kv_usage or 0.0
        x = min(1.0, (v.kv_usage - cfg.kv_knee) / (1.0 - cfg.kv_knee))
        return cfg.kv_penalty_s * x * x, v.kv_usage

    def _rows(self, ctx: PickContext) -> list[_Row]:
        st, cfg, f = self._state, self._state.config, ctx.features
        matches = st.index.match(f.block_hashes) if f.block_hashes else {}
        bound = LoadBound(ctx.views, cfg.load_factor, cfg.load_slack)
        prompt, tpb, key = f.prompt_tokens, cfg.tokens_per_block, ctx.tie_key
        quantum = cfg.tie_quantum_s
        rows: list[_Row] = []
        for v in ctx.views:
            m = matches.get(v.id, 0)
            uncached = float(prompt - max(0, min(prompt - 1, m * tpb)))
            queued, decode = self._queued(v)
            rate = st.rates.rate(v.id)
            penalty, kv = self._kv_penalty(v)
            cost = (queued + decode + uncached) / rate + penalty
            rank = (int(cost / quantum), mix(key, st.replica_hashes[v.id]))
            rows.append((rank, bound.admits(v), v, m, queued, decode, uncached, rate, kv, cost))
        return rows

    def choose(self, ctx: PickContext) -> Decision:
        rows = self._rows(ctx)
        rows.sort(key=lambda r: r[0])
        best_any = rows[0]
        ordered = [r for r in rows if r[1]] + [r for r in rows if not r[1]]
        chosen = ordered[0]
        if chosen is not best_any:
            reason = "overflow"
        elif chosen[3] > 0 and chosen[3] >= max(r[3] for r in rows):
            reason = "prefix-hit"
        else:
            reason = "least-cost"
        ranked = self._explain(ordered) if ctx.explain else ()
        return decide([r[2].id for r in ordered], reason, ranked)

    def _explain(self, rows: list[_Row]) -> tuple[Candidate, ...]:
        tpb = self._state.config.tokens_per_block
        low = max(min(r[9] for r in rows), 1e-9)
        out = []
        for r in rows:
            _, admitted, v, m, queued, decode, uncached, rate, kv, cost = r
            terms = {
                "matched_tokens": float(m * tpb),
                "uncached_tokens": uncached,
                "queued_tokens": queued,
                "decode_tokens": decode,
                "prefill_tps": rate,
                "kv_usage": kv,
                "inflight": float(v.inflight),
                "admitted": 1.0 if admitted else 0.0,
                "score": min(1.0, low / max(cost, 1e-9)),  # [0, 1], higher is better
            }
            out.append(Candidate(v.id, cost, terms))
        return tuple(out)
