"""Flow control's queue as the doctor reads it each tick: per pool, the requests queued so far
(``kvgate_flow_queued_total``, summed over tiers), the requests in the queue now
(``kvgate_flow_queue_depth``, summed over bands) and the requests it shed so far
(``kvgate_flow_shed_total``, summed over tiers and reasons: answered 503, or 429 past a tier's
wait)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Counter

    from gateway.flow import FlowGate

__all__ = ["flow_queues"]


def flow_queues(gate: FlowGate) -> Callable[[], dict[str, tuple[float, float, float]]]:
    def read() -> dict[str, tuple[float, float, float]]:
        queued, shed = _per_pool(gate.metrics.queued), _per_pool(gate.metrics.shed)
        depth = {name: float(sum(state.flow.queue.depth().values()))
                 for name, state in gate.pools().items()}
        return {pool: (queued.get(pool, 0.0), depth.get(pool, 0.0), shed.get(pool, 0.0))
                for pool in queued.keys() | depth.keys() | shed.keys()}

    return read


def _per_pool(counter: Counter) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                out[s.labels["pool"]] = out.get(s.labels["pool"], 0.0) + s.value
    return out
