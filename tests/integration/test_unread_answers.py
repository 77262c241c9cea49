"""A client that keeps its connection open but does not read a whole answer: the answer,
written in full, waits in the gateway's memory (uvicorn has no write timeout), so once the
client has taken nothing of it for `upstream.idle_timeout_s` the connection is reset and
counted (`kvgate_unread_answers_total`, `gateway/writewatch.py`); a client reading slowly,
even far slower than the answer takes to read in one period, gets all of it."""

from __future__ import annotations

import errno
import json
import socket
import time
from collections.abc import Callable

from tests.support.gateway import (
    gateway_proc,
    metric_values,
    request_statuses,
    unread_chat,
    wait_for,
)
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
PERIOD_S = 1.0  # the gateway's upstream.idle_timeout_s here
# ~20 MB of JSON (every token with 20 top logprobs): far more than the socket buffers between
# the gateway and a client with a tiny receive buffer (the gateway's grows to a few MB)
TOKENS = 16_000


def _ask_whole(port: int, tokens: int = TOKENS) -> socket.socket:
    return unread_chat(port, {"model": "sim-model", "max_tokens": tokens, "ignore_eos": True,
                              "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 20})


def _gateway(sim_factory: SimFactory) -> tuple[Proc, str, int]:
    _, sim = sim_factory("--time-scale", "1000")
    gw, base = gateway_proc(upstreams=[sim],
                            env={"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": str(PERIOD_S)})
    return gw, base, int(base.rsplit(":", 1)[1])


def _written(base: str) -> bool:
    """The whole answer is handed to the server (the request counted): only the client's
    reading is left."""
    return request_statuses(base).get("200") == 1


def test_a_whole_answer_left_unread_is_reset_and_counted(sim_factory: SimFactory) -> None:
    gw, base, port = _gateway(sim_factory)
    with gw:
        client = _ask_whole(port)
        try:
            wait_for(lambda: _written(base), timeout=60, what="the answer to be written")
            errors: list[int] = []

            def reset() -> bool:
                errors.append(client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                return errors[-1] != 0

            # the client never reads: reset about a period later (1.25 at most), not when it
            # closes its socket (without the watch, it stayed open as long as the client did)
            wait_for(reset, timeout=PERIOD_S + 15, what="the unread answer's connection reset")
            assert errors[-1] == errno.ECONNRESET  # a reset: the unsent bytes dropped
            assert metric_values(base, "kvgate_unread_answers_total") == {"": 1.0}
            assert request_statuses(base) == {"200": 1.0}  # the request itself, as before
        finally:
            client.close()
        output = gw.output(None)
        assert "client stopped reading its answer" in output
        assert "ERROR" not in output


def test_a_slow_reader_gets_the_whole_answer(sim_factory: SimFactory) -> None:
    """64 KB/s for several periods after the answer was written (each period, 64 KB of a 10 MB
    answer: the transport's buffer does not shrink in that time, only the socket's send
    queue), then the rest at full speed: all of it arrives."""
    gw, base, port = _gateway(sim_factory)
    with gw:
        client = _ask_whole(port, TOKENS // 2)
        got = bytearray()
        try:
            written_at: float | None = None
            start = time.monotonic()
            while written_at is None or time.monotonic() - written_at < 4 * PERIOD_S:
                pace = start + len(got) / 65536 - time.monotonic()  # 64 KB/s
                if pace > 0:
                    time.sleep(min(pace, 0.1))
                    if written_at is None and _written(base):
                        written_at = time.monotonic()
                    continue
                data = client.recv(8192)
                assert data, "the connection closed while the client read"
                got += data
                assert time.monotonic() - start < 120, "the answer was never written"
            client.settimeout(60)
            head, _, rest = bytes(got).partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert length > 8 << 20  # the answer is far larger than what was read slowly
            body = bytearray(rest)
            while len(body) < length:
                data = client.recv(1 << 20)
                assert data, "the connection closed before the whole answer"
                body += data
        finally:
            client.close()
        answer = json.loads(body)
        assert answer["usage"]["completion_tokens"] == TOKENS // 2
        assert metric_values(base, "kvgate_unread_answers_total") == {"": 0.0}
