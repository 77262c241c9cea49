"""Flow control: an admission queue per pool in front of the router, pure (time passed in).

`PoolFlow` (gate.py) holds a pool's `FlowQueue` (queue.py: priority bands, weighted fair
sharing across tenants in tokens, a minimum share per band, bounds; bands.py: its queued
requests, tenants and bands; pace.py: how fast it drains) behind the saturation rule
(saturation.py), and the share cap (share.py: what each tenant holds of the pool's in-flight
work). The live gateway wraps it in asyncio (``gateway/flow/``); the offline
replay drives it in simulated time (``loadtest/replay/flow.py``). Same code, same decisions.
"""

from routing.flow.bands import IDLE_FLOWS, Entry
from routing.flow.config import DEFAULT_MAX_WAIT_S, DEFAULT_MIN_SHARE, FlowConfig, Saturation
from routing.flow.gate import PoolFlow, Standing, request_cost
from routing.flow.queue import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, FlowQueue, Offer
from routing.flow.saturation import (
    full_reason,
    pool_saturated,
    projected_kv,
    replica_reasons,
    with_room,
    with_spare,
)
from routing.flow.share import Holdings, SendRates

__all__ = [
    "DEFAULT_MAX_WAIT_S",
    "DEFAULT_MIN_SHARE",
    "IDLE_FLOWS",
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "Entry",
    "FlowConfig",
    "FlowQueue",
    "Holdings",
    "Offer",
    "PoolFlow",
    "Saturation",
    "SendRates",
    "Standing",
    "full_reason",
    "pool_saturated",
    "projected_kv",
    "replica_reasons",
    "request_cost",
    "with_room",
    "with_spare",
]
