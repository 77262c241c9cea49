"""Flow control in the gateway: an admission queue per pool while the pool is saturated, around
the pure core (`routing.flow`); docs/flow-control.md.

- `gate.py`: `FlowGate` -- admit (straight through, spill-over, or wait in the pool's queue);
  built on `pump.py` (`FlowPump`: the pump that releases queued requests, shedding, held
  bands, moves on a key, tier or policy change) and `ledger.py` (`FlowLedger`: each pool's
  state, other gateways' load, each request's share of its pool until it is over).
- `tickets.py`: `Ticket`, `PoolState` -- a queued request's handle, a pool's flow state.
- `client_watch.py`: `ClientWatch`, `until_disconnect` -- whether a queued request's client left.
- `explain.py`: `flow_explain`, `pool_state` -- flow control as route explain and
  ``GET /admin/replicas`` show it (read only).
- `peer_lag.py`: `PeerLag` -- how late other gateways' sends reach this one (the window in
  which the saturation rule counts what they may have sent unseen, `routing.flow.unseen`).
- `cost.py`: `asked_tokens` -- what a request may consume (its prompt plus ``n`` x the output
  asked for; an embedding its prompt alone), held by flow control, reserved by TPM admission.
- `metrics.py`: the ``kvgate_flow_*`` families -- counters, and the queue gauges read when
  ``/metrics`` is scraped.
"""

from gateway.flow.cost import asked_tokens
from gateway.flow.explain import flow_explain, pool_state
from gateway.flow.gate import ClientWatch, FlowGate, until_disconnect
from gateway.flow.peer_lag import PeerLag

__all__ = ["ClientWatch", "FlowGate", "PeerLag", "asked_tokens", "flow_explain", "pool_state",
           "until_disconnect"]
