"""Connections to a Redis that answered at start reset later (a proxy or a load balancer in
front of Redis restarted, Redis's host rebooted): the shared routing state's log line read
"connection reset by peer (a Redis port that serves only TLS resets plain connections:
rediss:// in KVGATE_REDIS_URL?)", a hint meant for a URL that never worked, because the
sharing never recorded that Redis had answered at start. Real processes: redis-server, the
simulator, a gateway; a TCP relay between the gateway and Redis that resets connections."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc


class ResettingRelay:
    """Relays loopback TCP to `target`; `reset()` resets every connection, and every new one
    from then on, with a TCP RST."""

    def __init__(self, target: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._target = target
        self._resetting = threading.Event()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if self._resetting.is_set():
                _rst(conn)
                continue
            upstream = socket.create_connection(("127.0.0.1", self._target))
            with self._lock:
                self._open += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def reset(self) -> None:
        self._resetting.set()
        with self._lock:
            for conn in self._open:
                _rst(conn)
            self._open.clear()

    def close(self) -> None:
        self.reset()
        self.server.close()


def _rst(conn: socket.socket) -> None:
    """Close with a RST, not a FIN (SO_LINGER on, zero seconds)."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    except OSError:
        pass


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass


@pytest.fixture
def relay() -> Iterator[ResettingRelay]:
    proc, url = redis_proc()
    with proc:
        relay = ResettingRelay(int(url.rsplit(":", 1)[1].split("/")[0]))
        yield relay
        relay.close()


def _sync_lines(gw: Proc) -> list[str]:
    return [doc["msg"] for line in gw.output(tail=None).splitlines() if line.startswith("{")
            and (doc := orjson.loads(line))["logger"] == "gateway.fleet.sync"]


def test_a_reset_after_redis_answered_gets_no_tls_hint(
    sim_factory: Callable[..., tuple[Proc, str]], relay: ResettingRelay,
) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim],
                            env={"KVGATE_REDIS_URL": f"redis://127.0.0.1:{relay.port}/0"})
    with gw:
        wait_for(lambda: not httpx.get(f"{base}/readyz", timeout=5).json()["sync"]["degraded"],
                 30, "the sharing on")
        relay.reset()
        wait_for(lambda: any("cannot reach" in m for m in _sync_lines(gw)), 30, "the outage")
        said = [m for m in _sync_lines(gw) if "cannot reach" in m]
        assert "connection reset by peer" in said[0], said
        assert "rediss://" not in said[0] and "TLS" not in said[0], said
