"""Flow control's configuration: the saturation rule and the queue's bounds, every field
defaulted. The gateway's ``flow`` config section exposes these (``gateway/config.py``) and the
offline replay builds the same value, so both run the same rule with the same defaults. Why
each default is what it is: ``docs/flow-control.md`` (the benchmark behind them).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_WAIT_S", "DEFAULT_MIN_SHARE", "FlowConfig", "Saturation"]

DEFAULT_MAX_WAIT_S = 30.0  # a tier's longest wait in the queue (the policy may set its own)
DEFAULT_MIN_SHARE = 0.1  # a band's floor of the dispatched tokens while it has requests queued


@dataclass(frozen=True, slots=True)
class Saturation:
    """When a replica cannot take one more request without it queueing inside vLLM beyond the
    bound. A pool is saturated when none of its healthy replicas can (`routing.flow.saturation`).

    Each limit is fleet-wide when gateways share state (other gateways' in-flight work is
    added to this one's)."""

    # prompt tokens sent to the replica and not answered by a first token yet: the prefill
    # queue vLLM holds for it (exact: kvgate's own accounting, not a scrape)
    max_prefill_tokens: int = 16_384
    # requests sent to the replica and not answered by a first token yet, at or above this (exact:
    # kvgate's own count). Fresh where the scrape is not: it stops a burst of releases from
    # landing in vLLM's queue within one scrape interval. Those requests are prefilling or
    # waiting for a seat; a replica with room answers them within a step or two. High enough
    # that a burst of short prompts (prefilled together, one step) does not look like a queue.
    max_unanswered: int | None = 64
    # scraped vllm:num_requests_waiting above this: vLLM is queueing (no seat, no KV blocks)
    max_waiting: float = 4.0
    # scraped KV usage plus the unanswered prompts at or above this: what is admitted now grows
    # into the cache as it decodes, and past the knee vLLM preempts
    kv_knee: float = 0.9
    # requests in flight at or above this (None: no such limit; e.g. vLLM's --max-num-seqs)
    max_inflight: int | None = None

    def __post_init__(self) -> None:
        if self.max_prefill_tokens < 1:
            raise ValueError("flow.max_prefill_tokens must be >= 1")
        if self.max_unanswered is not None and self.max_unanswered < 1:
            raise ValueError("flow.max_unanswered must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("flow.max_waiting must be >= 0")
        if not 0.0 < self.kv_knee <= 1.0:
            raise ValueError("flow.kv_knee must be in (0, 1]")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError("flow.max_inflight must be >= 1")

    def scaled(self, factor: float) -> Saturation:
        """The same rule with every bound at ``factor`` of its value (0 < factor <= 1): full
        that much earlier. A count bound stays at least 1."""
        if factor >= 1.0:
            return self
        return Saturation(
            max_prefill_tokens=max(1, int(self.max_prefill_tokens * factor)),
            max_unanswered=None if self.max_unanswered is None
            else max(1, int(self.max_unanswered * factor)),
            max_waiting=self.max_waiting * factor,
            kv_knee=self.kv_knee * factor,
            max_inflight=None if self.max_inflight is None
            else max(1, int(self.max_inflight * factor)),
        )


@dataclass(frozen=True, slots=True)
class FlowConfig:
    saturation: Saturation = Saturation()
    # requests held per pool, all bands together; past it the least entitled one is shed
    max_queue: int = 1024
    # a request without max_tokens is charged this many output tokens (prompt + expected
    # output is what fair sharing counts)
    expected_output_tokens: int = 256
    # the dispatch-rate average (for Retry-After and explain's wait estimate), seconds
    rate_window_s: float = 10.0
    # a tenant holding more than this many times its weighted fair share of the pool's
    # in-flight tokens (`routing.flow.share`) is passed over by its band's other tenants; over
    # it also in the tokens sent lately (rate_window_s), it goes only to a replica with spare
    # room (`routing.flow.gate`) and waits while there is none (None: no such cap)
    share_cap: float | None = 2.0
    # "spare room": the saturation rule with every bound scaled by 1 - share_headroom, kept
    # with the request in. 0: no such wait (work-conserving: it waits only while others do)
    share_headroom: float = 0.5

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError("flow.max_queue must be >= 0")
        if self.expected_output_tokens < 0:
            raise ValueError("flow.expected_output_tokens must be >= 0")
        if self.rate_window_s <= 0:
            raise ValueError("flow.rate_window_s must be > 0")
        if self.share_cap is not None and not self.share_cap >= 1.0:
            raise ValueError("flow.share_cap must be >= 1")
        if not 0.0 <= self.share_headroom < 1.0:
            raise ValueError("flow.share_headroom must be in [0, 1)")
