"""Configuration of the routing core: one frozen value, every field defaulted and documented.

The meaning of each parameter, and why its default is what it is, is in ``routing/README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.tokens import CHARS_PER_TOKEN

__all__ = ["RouterConfig"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    # which policy `Router.pick` runs (see routing.policies.REGISTRY)
    policy: str = "cache_aware"
    # prefix hashing
    block_chars: int = 256
    max_blocks: int = 256
    # bounded load: a replica may take a request only while its in-flight load after the
    # assignment stays <= load_factor x pool mean + load_slack
    load_factor: float = 2.0
    load_slack: float = 4.0
    # affinity index: per-replica capacity when the replica's cache_config_info is unknown
    # (262,144 tokens is about an 8B model's KV on one 80 GB GPU)
    fallback_capacity_tokens: int = 262_144
    # scraped values older than this are ignored (fail open to kvgate's own accounting)
    stale_after_s: float = 1.0
    # cost model (cache_aware): TTFT = fixed part + work / rate, learned per replica
    # (routing.learning.TtftModel); rates in prompt tokens per second
    prior_prefill_tps: float = 8_000.0
    prior_fixed_s: float = 0.02
    prior_weight: float = 2.0  # the prior counts as this many observations (fleet fit)
    fleet_weight: float = 4.0  # the fleet's fit counts as this many (each replica's fit)
    rate_decay: float = 0.98  # per observation
    min_prefill_tps: float = 50.0
    max_fixed_s: float = 2.0
    outlier_factor: float = 4.0  # an observation counts at most this far from the prediction
    # prefill-token cost of one request decoding in the batch over the steps a prefill
    # waits (attention reads its whole context every step: ~11 for a 4k-token context,
    # 35-100 for the 16k-48k contexts of agents and long conversations; routing/README.md)
    decode_weight_tokens: float = 64.0
    # cache_aware: until the TTFT model has this many observations per candidate, a
    # replica's queue is at least its engine's scraped waiting requests x the mean request's
    # uncached tokens (the rates learned from a cold start's few first tokens drain queues
    # too fast: prefix-tree piled 20-34 requests on one replica); and until then the model
    # learns no counter interval with requests waiting at its scrapes (learning.py); 0 = never
    cold_observations: float = 32.0
    prior_request_tokens: float = 1_024.0
    kv_knee: float = 0.85
    kv_penalty_s: float = 1.0
    tie_quantum_s: float = 0.001
    tie_relative: float = 0.05  # costs in one step of a log scale of ratio 1 + this tie too
    # an uncached prompt token is charged miss_weight x its prefill time (>= 1; 1 = the pure
    # TTFT estimate); the extra is the fleet's price of recomputing and duplicating a prefix
    miss_weight: float = 2.0
    pending_ttl_s: float = 120.0
    # cache_aware: a request opening a new context (its longest match ends on no earlier
    # request's prompt) on a replica whose foreseen load is above the pool mean is charged up
    # to session_ramp_tokens of prefill, rising from the mean to session_ramp_factor x mean +
    # session_ramp_slack; the foreseen load is the larger of its requests in flight and its
    # live contexts (back twice in a row, each within session_window_s, the latest within it)
    # x the share of live contexts that came back; only while the pool's mean live contexts
    # x that share is at least session_ramp_min_mean (0 = off)
    session_ramp_tokens: float = 8_192.0
    session_window_s: float = 8.0
    session_ramp_factor: float = 2.0
    session_ramp_slack: float = 4.0
    session_ramp_min_mean: float = 0.5
    # a replica whose requests have waited silent_s (`ReplicaView`) longer than
    # max(silent_min_s, silent_factor x its predicted TTFT for one of the prompts waiting
    # there, their mean) is left out of the pick while another candidate is not (0 = off): a
    # frozen replica (stopped process, black-holed network, hung engine) looks idle to the
    # cost model, whose predicted queue drains with time, and drew most requests until
    # health ejected it; an engine answers a prompt in its turn, and a working one is heard
    # from between two scrapes (routing.scrape_interval_ms) while it decodes
    silent_min_s: float = 0.5
    silent_factor: float = 3.0
    # consistent_hash
    virtual_nodes: int = 64

    def __post_init__(self) -> None:
        if self.block_chars <= 0 or self.block_chars % CHARS_PER_TOKEN:
            raise ValueError(
                f"routing.block_chars must be a positive multiple of {CHARS_PER_TOKEN}"
            )
        if self.max_blocks <= 0:
            raise ValueError("routing.max_blocks must be positive")
        if self.load_factor < 1.0:
            raise ValueError("routing.load_factor must be >= 1.0")
        if self.load_slack < 1.0:  # below 1, an idle pool would admit no replica at all
            raise ValueError("routing.load_slack must be >= 1")
        if not 0.0 < self.rate_decay < 1.0:
            raise ValueError("routing.rate_decay must be in (0, 1)")
        if not 0.0 <= self.kv_knee < 1.0:
            raise ValueError("routing.kv_knee must be in [0, 1)")
        if min(self.prior_prefill_tps, self.prior_weight, self.fleet_weight,
               self.tie_quantum_s) <= 0:
            raise ValueError(
                "routing: prior_prefill_tps, prior_weight, fleet_weight, tie_quantum_s must be > 0"
            )
        if not 0.0 <= self.prior_fixed_s <= self.max_fixed_s or self.min_prefill_tps <= 0:
            raise ValueError(
                "routing: need 0 <= prior_fixed_s <= max_fixed_s and min_prefill_tps > 0"
            )
        if not 0.0 < self.tie_relative < 1.0:
            raise ValueError("routing.tie_relative must be in (0, 1)")
        if self.outlier_factor <= 1.0:
            raise ValueError("routing.outlier_factor must be > 1")
        if self.miss_weight < 1.0:
            raise ValueError("routing.miss_weight must be >= 1")
        if self.silent_min_s < 0 or self.silent_factor < 1.0:
            raise ValueError("routing: need silent_min_s >= 0 (0 = off) and silent_factor >= 1")
        if self.session_ramp_tokens < 0 or self.session_window_s <= 0:
            raise ValueError(
                "routing: need session_ramp_tokens >= 0 and session_window_s > 0")
        if (self.session_ramp_factor < 1.0 or self.session_ramp_slack <= 0
                or self.session_ramp_min_mean < 0):
            raise ValueError("routing: need session_ramp_factor >= 1, session_ramp_slack > 0 "
                             "and session_ramp_min_mean >= 0")
        if self.virtual_nodes <= 0:
            raise ValueError("routing.virtual_nodes must be positive")
        if not 0.0 <= self.cold_observations < float("inf"):
            raise ValueError("routing.cold_observations must be >= 0 (0 = off)")

    @property
    def tokens_per_block(self) -> int:
        return self.block_chars // CHARS_PER_TOKEN
