"""The doctor's rule for requests a pool's replicas refused with a 4xx (kvgate passes vLLM's
400 on as it is): the engine found the request invalid, most often a prompt plus
``max_tokens`` longer than its ``--max-model-len``. No engine class sees them (the engine
never started them: its TTFT count, its token counters stay still) and they are not 5xx, so a
pool answering every request 400 read as healthy and idle.
"""

from __future__ import annotations

import math

from gateway.doctor.findings import Finding, cite, known
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import PoolStats

__all__ = ["refused"]


def refused(p: PoolStats, th: Thresholds) -> Finding | None:
    """``refused_share`` of the pool's requests (of at least ``min_pool_requests``) answered
    4xx by its replicas: class errors, critical from half of them."""
    if p.requests < th.min_pool_requests or p.refused < th.refused_share * p.requests:
        return None
    share = min(1.0, p.refused / p.requests)
    lengths = {r.max_model_len for r in p.replicas if known(r.max_model_len)}
    length = min(lengths) if lengths else math.nan
    said = (f" (their --max-model-len: {length:,.0f} tokens"
            f"{' at the shortest' if len(lengths) > 1 else ''})" if known(length) else "")
    return Finding(
        "errors", "critical" if share >= 0.5 else "warning", p.name, None,
        f"{share:.0%} of pool {p.name}'s requests were refused by its replicas with a 4xx: "
        f"the engine found them invalid, most often a prompt plus max_tokens past its context "
        f"length{said}",
        "read the 4xx messages (the clients' errors, kvgate's request log): for 'maximum "
        "context length', raise the replicas' --max-model-len if their KV cache holds it, "
        "send long prompts to a pool with a longer one (a tier's spill_to), or have the "
        "clients shorten prompts and max_tokens; otherwise fix the clients' requests",
        [cite('kvgate_requests_total{status=~"4.."}', "share refused by the replicas (4xx)",
              share, ">=", th, "refused_share", "%"),
         cite("kvgate_requests_total", "requests", p.requests),
         cite("vllm /v1/models max_model_len", "shortest context length of the replicas",
              length, unit="tokens", note="" if known(length) else "not known yet")])
