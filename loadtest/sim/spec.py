"""Values that cross the engine's boundary: configuration, request specs, outputs, counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.sim.costmodel import CostModel

__all__ = ["FINISH_REASONS", "EngineConfig", "EngineStats", "RequestOutput", "RequestSpec"]

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What `vllm serve` flags decide for one replica's engine."""

    cost: CostModel
    num_gpu_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32_768
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (lower value first, like vLLM)

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        # vLLM refuses to start when one max_model_len sequence cannot fit in the KV cache.
        if -(-self.max_model_len // self.block_size) > self.num_gpu_blocks - 1:
            raise ValueError(
                f"max_model_len {self.max_model_len} needs more KV blocks than the "
                f"{self.num_gpu_blocks - 1} usable ones; lower --max-model-len or raise "
                "--num-gpu-blocks"
            )


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request as the engine sees it: blocks and counts, no text.

    ``block_hashes`` are the chained hashes of the prompt's FULL blocks (salt in the first block's
    hash only). The request generates ``max_tokens`` tokens and finishes with "length", unless
    ``eos_after`` is set, ``ignore_eos`` is false and ``eos_after <= max_tokens``: then it stops
    after ``eos_after`` tokens with "stop" (the natural end of the text, or a stop string).
    """

    request_id: str
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    eos_after: int | None = None
    ignore_eos: bool = False
    priority: int = 0


@dataclass(slots=True)
class RequestOutput:
    """What happened to one request during one `advance`/`step` call.

    ``new_tokens`` tokens were produced, the last at ``time``; ``first_token_time`` is set when the
    first token of the request is among them. ``finish_reason`` is set when it finished.
    """

    request_id: str
    new_tokens: int = 0
    time: float = 0.0
    first_token_time: float | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0  # total so far
    cached_tokens: int = 0  # prefix-cache hit at the request's first scheduling
    num_preemptions: int = 0
    prompt_tokens: int = 0
    scheduled_time: float | None = None  # first admitted to a batch (start of that step)


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters (vLLM's Prometheus counters are derived from these)."""

    received: int = 0
    prompt_tokens: int = 0  # prompt tokens of requests that produced their first token
    generation_tokens: int = 0
    prefill_tokens_computed: int = 0  # incl. recomputation after preemption
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    preemptions: int = 0
    # vLLM's request_prefill_time_seconds (scheduled -> first token) sum and count, and
    # request_prefill_kv_computed_tokens sum (prompt tokens not served from the cache)
    prefill_seconds: float = 0.0
    prefill_requests: int = 0
    prefill_computed_tokens: int = 0
    steps: int = 0
    fast_forwarded_steps: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
