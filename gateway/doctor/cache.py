"""Does prefix caching pay for the KV memory it holds? Per tenant and per pool, over a window.

Per tenant (and pool): prompt and cached tokens from the upstream answers' ``usage``
(``kvgate_tenant_tokens_total``; vLLM reports ``cached_tokens`` in chat/completions only with
``--enable-prompt-tokens-details``, the Responses API always). Per pool: the engines' own
prefix-cache counters (``vllm:prefix_cache_hits_total`` / ``_queries_total``, every request).
Prefill GPU-seconds saved = cached tokens / the router's learned prefill rate of the replica
(tokens per second of time to first token, so queueing is in it: an upper bound of the saving).
The share of KV memory a tenant's prefixes hold is not known (the engine does not say whose
blocks it holds); a pool's is its replicas' mean KV usage.

Verdict: ``caching pays`` at a hit rate >= ``cache_pays_hit``, else ``little reuse: the held
blocks buy nothing`` (saying how much of each prompt is reused: e.g. the RAG case -- a 2 KB
system prompt shared, 4-16 KB of retrieved context and a short query unique -- reuses only the
system prompt's few hundred tokens); below ``cache_min_prompt_tokens`` no verdict.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import PoolStats, Window

__all__ = ["CacheRow", "cache_return"]

PAYS = "caching pays"
LITTLE = "little reuse: the held blocks buy nothing"
UNKNOWN = "unknown: the replicas do not report cached_tokens (vLLM --enable-prompt-tokens-details)"
TOO_LITTLE = "not enough traffic to judge"


@dataclass
class CacheRow:
    tenant: str | None  # None: the pool's total
    pool: str
    requests: float
    prompt_tokens: float
    cached_tokens: float | None
    hit_rate: float | None
    cached_per_request: float | None
    prompt_per_request: float | None
    gpu_seconds_saved: float | None
    prefill_tps: float | None  # the rate the saving is computed with
    kv_share: float | None  # share of the pool's KV memory (None: not known)
    source: str  # "usage" (kvgate_tenant_tokens_total) or "engine" (vllm:prefix_cache_*)
    verdict: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}


def _num(v: float) -> float | None:
    return None if math.isnan(v) else v


def _verdict(prompt: float, hit: float | None, cached_per: float | None,
             prompt_per: float | None, saved: float | None, span_s: float,
             th: Thresholds, reported: float = 0.0) -> tuple[str, str]:
    if prompt < th.cache_min_prompt_tokens:
        return TOO_LITTLE, (f"{prompt:,.0f} prompt tokens in the window "
                            f"(< {th.cache_min_prompt_tokens:,.0f})")
    if hit is None:
        if reported > 0:
            return UNKNOWN, (f"only {reported:.0%} of the answers' usage carried cached_tokens: "
                             "some of the pool's replicas run without "
                             "--enable-prompt-tokens-details")
        return UNKNOWN, "cached_tokens missing from the answers' usage"
    if hit >= th.cache_pays_hit:
        busy = f" ({saved / span_s:.2f} GPUs busy otherwise)" if saved and span_s > 0 else ""
        saved_text = f"{saved:,.1f} GPU-s of prefill saved{busy}" if saved else "prefill saved"
        return PAYS, f"{hit:.0%} of prompt tokens served from cache: {saved_text}"
    if cached_per and prompt_per:
        return LITTLE, (f"only ~{cached_per:,.0f} of ~{prompt_per:,.0f} prompt tokens per "
                        "request come from the cache (a shared prefix, e.g. a system prompt); "
                        "the rest is recomputed and the blocks kept for it are not reused")
    return LITTLE, "almost nothing is served from the cache"


def _why_little(p: PoolStats, th: Thresholds) -> str:
    """Little reuse in a pool: the traffic's own prefix sharing (sampled at routing time) tells
    prompts that differ from their first blocks -- unique, or a timestamp or request id before
    a shared system prompt -- from shared prefixes the caches lose (eviction, routing)."""
    potential = p.potential_hit_rate
    if math.isnan(potential):
        return ""
    if potential < th.cache_pays_hit:
        return (f"; the traffic itself shares little: at routing time the best replica held "
                f"{potential:.0%} of the prompts' prefix blocks (sampled), so the prompts "
                "differ from their first blocks -- unique prompts, or a varying start (a "
                "timestamp, a request id) before a shared part: put what is shared first")
    return (f"; yet at routing time the best replica held {potential:.0%} of the prompts' "
            "prefix blocks (sampled): the shared prefixes are evicted before they are reused "
            "or sent elsewhere (the pool's routing finding says which)")


def _pool_rate(p: PoolStats) -> float:
    rates = [r.prefill_rate for r in p.replicas if not math.isnan(r.prefill_rate)]
    return sum(rates) / len(rates) if rates else math.nan


def cache_return(w: Window, th: Thresholds) -> tuple[list[CacheRow], list[CacheRow]]:
    """(per tenant and pool, per pool) cache return over the window."""
    pools = {p.name: p for p in w.pools}
    tenants = []
    for t in w.tenants:
        p = pools.get(t.pool)
        rate = _pool_rate(p) if p is not None else math.nan
        known = t.cached_reported >= 0.9 * t.requests
        cached = t.cached_tokens if known else None
        hit = cached / t.prompt_tokens if cached is not None and t.prompt_tokens > 0 else None
        per = cached / t.requests if cached is not None and t.requests else None
        prompt_per = t.prompt_tokens / t.requests if t.requests else None
        saved = cached / rate if cached is not None and rate > 0 else None
        verdict, detail = _verdict(t.prompt_tokens, hit, per, prompt_per, saved,
                                   w.tenant_span_s, th, t.cached_reported / t.requests)
        tenants.append(CacheRow(t.tenant, t.pool, t.requests, t.prompt_tokens, cached, hit, per,
                                prompt_per, saved, _num(rate), None, "usage", verdict, detail))
    by_pool = []
    for p in w.pools:
        reps = p.replicas
        queries = sum(r.queries for r in reps)
        hits = sum(r.hits for r in reps)
        prompt = sum(r.prompt_tokens for r in reps) or p.prompt_tokens
        requests = sum(r.requests for r in reps if not math.isnan(r.requests))
        hit = hits / queries if queries > 0 else None
        saved = sum(r.hits / r.prefill_rate for r in reps
                    if r.prefill_rate and not math.isnan(r.prefill_rate))
        kv = [r.kv_mean for r in reps if not math.isnan(r.kv_mean)]
        per = hits / requests if requests else None
        prompt_per = prompt / requests if requests else None
        verdict, detail = _verdict(prompt, hit, per, prompt_per, saved, w.span_s, th)
        if verdict == LITTLE:
            detail += _why_little(p, th)
        by_pool.append(CacheRow(None, p.name, requests, prompt, hits, hit, per, prompt_per,
                                saved, _num(_pool_rate(p)), sum(kv) / len(kv) if kv else None,
                                "engine", verdict, detail))
    return tenants, by_pool
