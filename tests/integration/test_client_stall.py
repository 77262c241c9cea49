"""A client that stops reading a stream: its stall is not the replica's. The request ends
(counted, its counters released) once kvgate has been blocked handing it a chunk for
`upstream.idle_timeout_s`, and the replica is not taken out however many clients do it; its
connection is reset without an ERROR line from the server (one a client could repeat at will)."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from pathlib import Path

import orjson

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.gateway import (
    gateway_proc,
    inflight,
    metric_values,
    request_statuses,
    unread_chat,
    wait_for,
)
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
STALLS = 3  # more than the test gateways' failure_threshold (2)


def _stalled_stream(port: int, model: str = "sim-model") -> socket.socket:
    """Ask for a stream far longer than the socket buffers between kvgate and the client
    (~40 MB of events: loopback buffers grow to a few MB), on a socket with a tiny receive
    buffer, and never read it."""
    return unread_chat(port, {"model": model, "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 250_000, "ignore_eos": True, "stream": True})


def test_a_client_that_stops_reading_ends_its_request_and_not_the_replica(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "1000", "--max-model-len", "262144",
                         "--num-gpu-blocks", "8192")
    # health probes once, at start: the simulator writing ~40 MB of events per stream at 1000x
    # answers /health late on a busy machine, and the probe's ejection is not under test
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "1",
                                                  "KVGATE_HEALTH__INTERVAL_S": "60"})
    port = int(base.rsplit(":", 1)[1])
    with gw:
        stalled: list[socket.socket] = []
        try:
            def counted(n: int) -> bool:
                done = metric_values(base, "kvgate_requests_total")
                return sum(v for k, v in done.items() if 'status="408"' in k) == n

            # one at a time: three streams at once starved one another in the simulator on a
            # busy machine (a second without a chunk: the replica's idle timeout, a 504)
            for n in range(1, STALLS + 1):
                stalled.append(_stalled_stream(port))
                # ended while the client is still connected, not when it goes
                wait_for(lambda n=n: counted(n), timeout=60,  # type: ignore[misc]
                         what="the stalled stream to be counted (408)")
            assert sum(metric_values(base, "kvgate_inflight_requests").values()) == 0
            assert list(metric_values(base, "kvgate_replica_healthy").values()) == [1.0]
        finally:
            for s in stalled:
                s.close()
        output = Path(gw._log.name).read_text(errors="replace")  # all of it, not the tail
        assert "stopped reading" in output
        # the connection is reset, not left to uvicorn as an app that did not finish
        assert "ASGI callable returned without completing response" not in output


def test_a_stalled_streams_client_sees_a_reset(sim_factory: SimFactory) -> None:
    """The cut is a reset: the client's next read fails (ECONNRESET), and the megabytes the
    gateway's socket still held are dropped -- not handed over and followed by a normal close,
    which a client could take for a stream that simply ended."""
    _, sim = sim_factory("--time-scale", "1000", "--max-model-len", "262144",
                         "--num-gpu-blocks", "8192")
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "1",
                                                  "KVGATE_HEALTH__INTERVAL_S": "60"})
    with gw:
        client = _stalled_stream(int(base.rsplit(":", 1)[1]))
        try:
            wait_for(lambda: request_statuses(base).get("408") == 1, timeout=60,
                     what="the stalled stream to be counted (408)")
            client.settimeout(30)
            got = 0
            try:
                while data := client.recv(1 << 16):
                    got += len(data)
            except ConnectionResetError as exc:
                assert exc.errno == errno.ECONNRESET
            else:
                raise AssertionError(f"a normal close after {got} bytes, not a reset")
        finally:
            client.close()


def test_a_client_that_stops_reading_as_its_stream_ends_is_cut_too() -> None:
    """The replica's last bytes come while the client's socket is full: the stream is whole
    (nothing may cut it any more), and its last send waited for the client as long as it
    kept its connection open -- the request in flight, its replica and tenant counted. One
    event larger than every buffer between kvgate and the client, and [DONE] in the same
    read, make it so without timing."""
    event = b"data: " + orjson.dumps({
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "x" * (8 << 20)}}]}) + b"\n\n"
    with BadReplica("m", answer=sse_head() + chunked(event + b"data: [DONE]\n\n")) as replica:
        gw, base = gateway_proc(upstreams=[replica.url],
                                env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "1"})
        with gw:
            client = _stalled_stream(int(base.rsplit(":", 1)[1]), "m")
            try:
                wait_for(lambda: request_statuses(base).get("408") == 1, timeout=60,
                         what="the stalled stream to be counted (408)")
                assert inflight(base) == 0
            finally:
                client.close()
            assert "stopped reading" in gw.output(None)
