"""SIGTERM while a client has sent its request's head and not a byte of its body yet (an
upload that has not begun: a client that announced a large body, or one stalled right after
its headers): at the end of `server.shutdown_grace_s` the request is answered with an
OpenAI-shaped 503, as a body half sent is. Before, the first read of the body was not
interruptible: the server cancelled the task at exit and the client got uvicorn's text/plain
"Internal Server Error"."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


def test_a_body_not_begun_at_the_end_of_the_grace_gets_a_503(sim_factory: SimFactory) -> None:
    _, sim = sim_factory()
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_SERVER__SHUTDOWN_GRACE_S": "1"})
    with gw:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                      b"content-length: 100\r\n\r\n")
            time.sleep(0.3)  # the request is in the app, waiting for its body
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
    error = json.loads(body)["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert "shutting down" in error["message"]
    assert answered_in < 2.5, f"answered {answered_in:.1f} s after SIGTERM (grace 1 s)"
    assert "without starting response" not in output
