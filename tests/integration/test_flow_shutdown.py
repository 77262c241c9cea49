"""SIGTERM with requests queued in flow control: they are answered 503 (`Retry-After`,
recorded "interrupted") when shutdown starts, not at the end of the grace, while the streams
in flight keep the grace to finish. A queued request used to wait out the whole grace (30 s
by default) for its 503, or be sent in it to start a stream the grace would cut.

One simulated replica whose streams hang after two tokens, ``flow.max_inflight: 1``: a held
stream saturates the pool, a second request waits, written on a raw connection.
"""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Callable

import httpx

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

BODY = json.dumps({"model": "llama", "max_tokens": 50, "stream": True,
                   "messages": [{"role": "user", "content": "hello"}]}).encode()
GRACE_S = 60


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def _answer(client: socket.socket) -> tuple[bytes, bytes]:
    """The head and body of the answer on ``client`` (its content-length read whole)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = client.recv(65536)
        assert more, data  # (closed without an answer)
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")))
    while len(body) < length:
        more = client.recv(65536)
        if not more:
            break
        body += more
    return head, body


def test_queued_requests_are_answered_when_shutdown_starts(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "tiers": {"default": {"flow": {"max_wait_s": 2 * GRACE_S}}},
              "flow": {"enabled": True, "max_inflight": 1},
              "server": {"shutdown_grace_s": GRACE_S, "log_level": "info"}}
    gw, base = gateway_proc(config=config)
    with gw:
        with httpx.Client(timeout=30) as http, http.stream(
                "POST", f"{base}/v1/chat/completions", content=BODY,
                headers={"content-type": "application/json"}) as held:
            chunks = held.iter_raw()
            next(chunks)  # it runs, and hangs: the pool is saturated
            client = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
                           % len(BODY) + BODY)
            wait_for(lambda: _depth(base) == 1, 10, "the request to queue")
            gw.signal(signal.SIGTERM)
            client.settimeout(GRACE_S / 2)  # (it was answered only when the grace ended)
            head, body = _answer(client)
            client.close()
            assert head.startswith(b"HTTP/1.1 503"), head
            assert b"retry-after: 1" in head.lower(), head
            assert b"shutting down" in body, body
            assert gw.popen is not None and gw.popen.poll() is None  # the stream's grace
        assert gw.popen.wait(15) == 0  # the held stream ended: nothing left to wait for
        line = next(ln for ln in gw.output(None).splitlines()
                    if '"msg":"request"' in ln and '"queued_ms":null' not in ln)
    assert '"status":503' in line and '"route":"interrupted"' in line, line
