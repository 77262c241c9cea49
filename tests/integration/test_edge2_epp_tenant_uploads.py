"""Through Envoy, as at the HTTP edge, one tenant's request bodies still arriving hold at most
half of `server.max_pending_body_bytes` (or one whole body when that is more): the picker
bounded them all together only, so one tenant's stalled uploads could fill the bound and every
other tenant's body arriving in parts got a 503 until they timed out. Real picker, real Envoy,
a simulated replica; raw sockets hold uploads unfinished."""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator

import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import AUTH_SECRET, admin_client, wait_for
from tests.support.procs import Proc, sim_proc

ADMIN = "edge2-epp-uploads-admin-token-0123456"
BOUND = 1_000_000  # server.max_pending_body_bytes; a tenant's share: 500,000
BODY = 400_000  # each upload's size; 300,000 of it sent, the rest held back
SENT = 300_000


@pytest.fixture
def stack() -> Iterator[tuple[str, str, str]]:
    """(Envoy's base URL, a key of tenant a, one of tenant b)."""
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "50", model="m")
        procs.append(sim.start())
        config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
                  "models": {"m": {"default": "p"}},
                  "server": {"max_pending_body_bytes": BOUND, "max_body_bytes": 450_000},
                  "tenants": [{"id": "a", "tier": "default"}, {"id": "b", "tier": "default"}]}
        epp = epp_proc(config=config, env={"KVGATE_SALT_SECRET": AUTH_SECRET,
                                           "KVGATE_ADMIN_TOKEN": ADMIN}, auth=True)
        procs.append(epp.start())
        with admin_client(epp.base, ADMIN) as admin:
            keys = [admin.post(f"/tenants/{t}/keys").json()["key"] for t in ("a", "b")]
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        yield base, keys[0], keys[1]
    finally:
        for proc in reversed(procs):
            proc.stop()


def _body() -> bytes:
    """A chat request of `BODY` bytes (its `user` field pads it)."""
    head = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2})[:-1].encode() + b', "user": "'
    return head + b"u" * (BODY - len(head) - 2) + b'"}'


def _upload(base: str, key: str, body: bytes) -> socket.socket:
    """A POST of `body` whose first `SENT` bytes are written, the rest held back."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (key.encode(), len(body), body[:SENT]))
    return sock


def _answered(socks: list[socket.socket]) -> bytes:
    """The answer's head and body one of `socks` got (b"": none answered yet)."""
    ready, _, _ = select.select(socks, [], [], 0)
    if not ready:
        return b""
    got = ready[0].recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                   if line.startswith(b"content-length:")), 0)
    while len(body) < length and (more := ready[0].recv(65536)):
        got, body = got + more, body + more
    return got


def test_one_tenants_unfinished_uploads_leave_room_for_the_others(
    stack: tuple[str, str, str],
) -> None:
    base, key_a, key_b = stack
    body = _body()
    # tenant a: 900,000 bytes held if all were taken (under the bound, over a's share)
    held = [_upload(base, key_a, body) for _ in range(3)]
    try:
        seen = [b""]

        def refused() -> bool:
            seen[0] = _answered(held)
            return bool(seen[0])

        wait_for(refused, timeout=30, what="one of tenant a's uploads past its share refused")
        head, _, rest = seen[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), seen[0]
        assert b"This tenant is sending too many request bodies" in rest, seen[0]
        late = _upload(base, key_b, body)  # tenant b's, arriving in parts meanwhile
        held.append(late)
        late.sendall(body[SENT:])
        answer = late.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
    finally:
        for sock in held:
            sock.close()
