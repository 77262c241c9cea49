"""Flow control's queue as the doctor reads it each tick: per pool, the requests queued so far
(``kvgate_flow_queued_total``, summed over tiers) and the requests in the queue now
(``kvgate_flow_queue_depth``, summed over bands)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.flow import FlowGate

__all__ = ["flow_queues"]


def flow_queues(gate: FlowGate) -> Callable[[], dict[str, tuple[float, float]]]:
    def read() -> dict[str, tuple[float, float]]:
        queued: dict[str, float] = {}
        for family in gate.metrics.queued.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    pool = s.labels["pool"]
                    queued[pool] = queued.get(pool, 0.0) + s.value
        depth = {name: float(sum(state.flow.queue.depth().values()))
                 for name, state in gate.pools().items()}
        return {pool: (queued.get(pool, 0.0), depth.get(pool, 0.0))
                for pool in queued.keys() | depth.keys()}

    return read
