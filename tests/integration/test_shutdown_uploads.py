"""SIGTERM while a client is still sending its body (a slow upload): at the end of
`server.shutdown_grace_s` the request is answered with an OpenAI-shaped 503 and the process
exits 0 at once. Before, nothing stopped the body read: the server cancelled the task at exit
and the client got uvicorn's text/plain "Internal Server Error" (logged as an ERROR, "ASGI
callable returned without starting response"), two seconds later. The same for a client that
has sent its request's head and not a byte of its body yet (the first read of the body was
not interruptible either)."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable

import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
BODY = json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()


@pytest.mark.parametrize("sent", [10, 0], ids=["half-sent", "not-begun"])
def test_a_body_still_arriving_at_the_end_of_the_grace_gets_a_503(
    sim_factory: SimFactory, sent: int,
) -> None:
    _, sim = sim_factory()
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_SERVER__SHUTDOWN_GRACE_S": "1"})
    with gw:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                      b"content-length: %d\r\n\r\n" % len(BODY) + BODY[:sent])
            time.sleep(0.3)  # the request is in the app, reading its body
            gw.signal(signal.SIGTERM)
            began = time.monotonic()
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
            answered_in = time.monotonic() - began
        assert gw.popen is not None
        assert gw.popen.wait(20) == 0, gw.output()
        output = gw.output(None)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), raw
    assert b"retry-after: 1" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert "shutting down" in error["message"]
    assert answered_in < 2.5, f"answered {answered_in:.1f} s after SIGTERM (grace 1 s)"
    assert "without starting response" not in output
