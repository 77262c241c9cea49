"""The routing core's contract: frozen values in, a `Decision` out.

The gateway and the offline replayer build these from their own state and call
`Router.pick(features, views, now)`; nothing here performs I/O or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Candidate", "Decision", "ReplicaView", "RequestFeatures"]


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router may know about one replica at pick time.

    Scraped fields are ``None`` when no fresh scrape exists (the router then relies on the
    gateway's own accounting). ``inflight*`` fields are the gateway's own, always fresh;
    other gateways' shared load (`routing.peers`) comes beside them in `PickContext.peer_loads`
    for a policy that reads it (`reads_peer_loads`), else `Router.pick` adds it to them.
    """

    id: str
    pool: str
    healthy: bool = True
    # scraped from vLLM's /metrics (possibly stale by up to `scrape_age_s`)
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    cache_capacity_tokens: int | None = None  # num_gpu_blocks x block_size
    scrape_age_s: float | None = None
    # the gateway's own accounting
    inflight: int = 0  # requests sent and not finished
    inflight_prefill_tokens: int = 0  # prompt tokens sent and not yet answered by a first token
    inflight_prefill: int = 0  # requests sent and not yet answered by a first token (0 = unknown)
    # other gateways' predicted uncached prefill work here (`routing.peers`); their requests
    # are already counted in the inflight* fields above, which are fleet-wide when shared
    peer_prefill_work: float = 0.0
    # how long requests have waited here for a first token with nothing heard from it since
    # (no first token or whole answer of any, no engine counter moving): the gateway's own
    # accounting, 0 while nothing waits; a frozen replica's grows (`Router` leaves it out)
    silent_s: float = 0.0
    # the longest context its engine takes (its /v1/models card's ``max_model_len``; None:
    # not known): a prompt past it is refused there (vLLM's 400), served by a longer one
    max_model_len: int | None = None


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What the router may know about one request."""

    model: str  # public model name
    block_hashes: tuple[int, ...]  # salted chained prefix block hashes (full blocks only)
    prompt_tokens: int  # estimate under routing.tokens
    tenant: str = "default"
    tier: str = "default"
    stream: bool = False
    priority: int = 0
    # a stable 64-bit hash of the whole canonical prompt (salted); ties are broken with it
    prefix_key: int = 0
    prompt_chars: int = 0
    # the output tokens it asks for at most (``max_completion_tokens``, ``max_tokens`` or
    # ``max_output_tokens``; 0: not said): vLLM refuses a prompt and these past its context
    output_tokens: int = 0

    @property
    def context_tokens(self) -> int:
        """The context it takes: its prompt and the output it asks for (at least one token);
        a replica whose ``max_model_len`` is shorter refuses it."""
        return self.prompt_tokens + max(self.output_tokens, 1)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One ranked candidate with the terms of its score (for explain and debugging)."""

    replica: str
    cost: float
    terms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to send a request, where to go if that fails, and why."""

    replica: str
    fallbacks: tuple[str, ...]
    reason: str  # e.g. "prefix-hit", "least-cost", "overflow", "round-robin"
    ranked: tuple[Candidate, ...] = ()
