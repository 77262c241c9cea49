"""Envoy's limit on client connections, as kvgate's bootstrap sets it
(`envoy_config(max_connections=)`, `kvgate envoy --max-connections`): the overload manager's
connection monitor. Without it Envoy took any number of connections (a client opening them
in a loop exhausted its file descriptors, the picker's streams with them) and warned at every
start that no limit was configured. Here the limit is 2: a third connection is closed at once,
and one is taken again when another closes. No picker is needed: idle connections never
reach it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.epp import envoy_proc
from tests.support.gateway import wait_for

NO_LIMIT_WARNING = "no configured limit to the number of allowed active downstream connections"


def _connect(base: str) -> socket.socket:
    parts = urlsplit(base)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
    sock.settimeout(1.5)
    return sock


def _closed_by_envoy(sock: socket.socket) -> bool:
    """True when Envoy closed the connection (EOF or reset) within the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _accepted(admin: str) -> int:
    """The client connections Envoy holds open (its listener's, not its admin's)."""
    stats = httpx.get(f"{admin}/stats", params={"filter": "downstream_cx_active$"}, timeout=5)
    return sum(int(value) for name, _, value in
               (line.partition(": ") for line in stats.text.splitlines())
               if name.startswith("listener.") and not name.startswith("listener.admin.")
               and ".worker_" not in name)  # (a worker's share of the listener's count)


@pytest.fixture(scope="module")
def edge() -> Iterator[tuple[str, str, str]]:
    proc, base = envoy_proc("127.0.0.1:1", max_connections=2)
    assert proc.ready_url is not None
    with proc:
        proc.start()
        yield base, proc.output(), proc.ready_url.removesuffix("/ready")


def test_envoy_starts_without_the_no_limit_warning(edge: tuple[str, str, str]) -> None:
    _, started, _ = edge
    assert NO_LIMIT_WARNING not in started


def test_a_connection_past_the_limit_is_closed_and_one_is_taken_again_after(
    edge: tuple[str, str, str],
) -> None:
    base, _, admin = edge
    held = [_connect(base), _connect(base)]
    try:
        wait_for(lambda: _accepted(admin) == 2, timeout=10, what="both accepted and counted")
        extra = _connect(base)  # the kernel completes the handshake; Envoy closes it
        with extra:
            assert _closed_by_envoy(extra)
        for sock in held:
            assert not _closed_by_envoy(sock)  # those within the limit stay open
        held.pop().close()

        def accepted() -> bool:
            with _connect(base) as again:
                return not _closed_by_envoy(again)

        wait_for(accepted, timeout=10, what="a connection accepted once one closed")
    finally:
        for sock in held:
            sock.close()
