"""A queued request whose client closes its connection (a FIN: an SDK's timeout, a process
that exits) is never sent to a replica, even when a slot frees the moment it left.

The HTTP edge takes a FIN after a whole request for a possible half-close and probes the
client first (`gateway.halfclose`: the client's reset comes back within a round trip, read
`PROBE_S` later). A slot that freed meanwhile released the request from the queue, and it was
sent to the replica before its client was known gone (a client process exiting with a stream
and a queued request open: both closed at once, and the queued one reached the replica).
Now a request released while its client's FIN is being probed waits for the probe's answer,
and one whose client left is abandoned, not sent.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from functools import partial

import httpx

from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

BODY = json.dumps({"model": "llama", "max_tokens": 50, "stream": True,
                   "messages": [{"role": "user", "content": "hello"}]}).encode()


def _total(base: str, name: str) -> float:
    return sum(metric_values(base, name).values())


def _dequeued(base: str, n: int) -> bool:
    return _total(base, "kvgate_flow_dequeued_total") == n


def _received(sim: str) -> int:
    return int(httpx.get(f"{sim}/sim/stats", timeout=10).json()["received"])


def _send(base: str) -> socket.socket:
    """A streamed chat request written on a raw connection."""
    client = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                   b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY)
                   + BODY)
    return client


def test_a_queued_request_whose_client_closed_is_not_sent_when_a_slot_frees(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "flow": {"enabled": True, "max_inflight": 1}}
    gw, base = gateway_proc(config=config)
    with gw:
        for left in range(1, 4):
            holder = _send(base)
            assert holder.recv(4096).startswith(b"HTTP/1.1 200")  # it runs (and hangs)
            sent = _received(sim)
            leaver = _send(base)
            wait_for(lambda: _total(base, "kvgate_flow_queue_depth") == 1, 10,
                     "the request to queue")
            leaver.close()  # a FIN: probed before it is taken for a client gone
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            holder.close()  # a reset: its stream ends at once, and its slot frees
            wait_for(lambda: _total(base, "kvgate_flow_queue_depth") == 0
                     and inflight(base) == 0, 10, "the queue and the replica to empty")
            wait_for(partial(_dequeued, base, left), 10, "the queued request to leave the queue")
            assert metric_values(base, "kvgate_flow_dequeued_total") == {
                '{outcome="abandoned",pool="p",tier="default"}': left}
            assert _received(sim) == sent
