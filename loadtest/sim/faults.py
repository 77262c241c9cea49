"""Fault switches of one simulated replica, settable by CLI flags and by `POST /sim/faults`."""

from __future__ import annotations

import asyncio
import math
import random
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["Faults"]

# one sample of the KV usage gauge (current or deprecated name), its labels kept
_KV_LINE = re.compile(rb"^(vllm:(?:kv|gpu)_cache_usage_perc(?:\{[^}]*\})?) \S+$", re.M)


@dataclass(slots=True)
class Faults:
    """Current faults. ``0``/``False``/``-1`` mean off."""

    latency_ms: float = 0.0  # wall-clock delay before a request enters the engine
    # plus up to this much more, a fixed fraction per prompt (the same prompt always waits the
    # same): arrivals of a closed-loop load spread out instead of moving in lockstep waves
    latency_jitter_ms: float = 0.0
    error_rate: float = 0.0  # probability that a generation request fails
    error_status: int = 500  # 500 or 503
    max_num_queued_reqs: int = 0  # admission limit on waiting + running (vLLM's flag), 0 = off
    # a dead engine (vLLM's EngineDeadError): /health 503, new requests 500 InternalServerError,
    # in-flight streams end with an SSE error event (code 500) and `data: [DONE]`
    dead: bool = False
    drop_connections: bool = False  # in-flight and new connections closed without an answer
    # vLLM's fault-tolerance pause: new requests 503 while /health stays 200
    engine_faulted: bool = False
    # /health answers this much later (vLLM serves it on the same, possibly busy, event loop)
    health_latency_ms: float = 0.0
    hang_after_tokens: int = -1  # stop sending after K tokens and hang until the client leaves
    # the engine stops stepping (`EngineRunner.hold`): no token for any request, its counters
    # frozen, requests still counted running; /health and /metrics answer 200 as usual
    engine_hang: bool = False
    # vLLM's sleep mode (`POST /sleep?level=N`, dev mode): 0 awake, 1 weights offloaded, 2
    # all discarded. The engine schedules nothing (as `engine_hang`: requests wait, counters
    # freeze) and `vllm:engine_sleep_state` says so; /health and /v1/models answer as usual
    sleeping: int = 0
    # gray faults of the metrics exporter alone (requests are served as usual): /metrics
    # answers this much later, or with this status (0: as usual), or says the KV cache is
    # empty (`kv_usage_zero`: vllm:kv_cache_usage_perc 0 whatever it holds)
    metrics_latency_ms: float = 0.0
    metrics_status: int = 0
    kv_usage_zero: bool = False
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)
        self.validate()

    def validate(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be in [0, 1]")
        if self.error_status not in (500, 503):
            raise ValueError("error_status must be 500 or 503")
        amounts = (self.latency_ms, self.latency_jitter_ms, self.max_num_queued_reqs,
                   self.health_latency_ms, self.metrics_latency_ms)
        if not all(0 <= a < math.inf for a in amounts):  # (nan passed a `< 0` test)
            raise ValueError("latency_ms, latency_jitter_ms, max_num_queued_reqs, "
                             "health_latency_ms and metrics_latency_ms must be finite, >= 0")
        # (404: what answers at the address has no /metrics: a proxy that routes /v1 only)
        if self.metrics_status not in (0, 404, 500, 503):
            raise ValueError("metrics_status must be 0, 404, 500 or 503")
        if self.sleeping not in (0, 1, 2):
            raise ValueError("sleeping must be 0 (awake), 1 or 2 (vLLM's sleep levels)")

    @property
    def engine_held(self) -> bool:
        """The engine takes no step: hung, or asleep."""
        return self.engine_hang or self.sleeping > 0

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update; unknown keys or wrong types raise ValueError, nothing changes."""
        known = {f.name: f for f in fields(self) if not f.name.startswith("_")}
        staged = self.to_dict()
        for key, value in changes.items():
            if key not in known:
                raise ValueError(f"unknown fault {key!r}")
            current = staged[key]
            if isinstance(current, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{key} must be a boolean")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number")
            staged[key] = type(current)(value)
        candidate = Faults(**staged)
        for key in known:
            setattr(self, key, getattr(candidate, key))
        if "seed" in changes:
            self._rng.seed(self.seed)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    def delay_s(self, prompt_seed: int) -> float:
        """The wall-clock delay for a request whose prompt hashes to `prompt_seed`."""
        spread = self.latency_jitter_ms * ((prompt_seed % 1000) / 1000.0)
        return (self.latency_ms + spread) / 1000.0

    async def metrics_answer(self, page: bytes) -> tuple[int, bytes]:
        """The status and body `/metrics` answers with the exporter's faults applied."""
        if self.metrics_latency_ms > 0:
            await asyncio.sleep(self.metrics_latency_ms / 1000.0)
        if self.metrics_status == 404:
            return 404, b'{"detail":"Not Found"}'
        if self.metrics_status:
            return self.metrics_status, b"Internal Server Error"
        if self.kv_usage_zero:
            page = _KV_LINE.sub(rb"\1 0.0", page)
        return 200, page

    def should_fail(self) -> bool:
        return self.error_rate > 0 and self._rng.random() < self.error_rate
