"""The HTTP edge against a hostile client on the network: bytes written on raw sockets to a
real `kvgate serve` with authentication on, before a simulated replica."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import sim_proc

ADMIN = "edge-attacks-admin-token-0123456789"
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def edge() -> Iterator[tuple[int, str]]:
    """(the gateway's port, a tenant's API key)."""
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"m": {"default": "p"}},
              "tenants": [{"id": "acme", "tier": "default"}]}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    with sim:
        gw, base = gateway_proc(config=config, env=env, auth=True)
        with gw, admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
            yield int(base.rsplit(":", 1)[1]), key


def exchange(port: int, data: bytes) -> bytes:
    """Write `data` on a new connection and read until the gateway closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def answer(raw: bytes) -> tuple[int, dict[bytes, bytes], dict[str, object]]:
    """(status, headers, JSON body) of the one answer in `raw`."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_edge_a_trailer_field_is_not_a_request_header(edge: tuple[int, str]) -> None:
    """A chunked body's trailer fields are not the request's headers (RFC 9110 6.5.1): an
    `Authorization` sent there, where a proxy in front checking headers never looks, does not
    authenticate the request, nor does an `X-Request-Id` there name it."""
    port, key = edge
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n"
               b"Authorization: Bearer %s\r\nX-Request-Id: from-the-trailer\r\n\r\n"
               % (len(CHAT), CHAT, key.encode()))
    status, headers, body = answer(exchange(port, request))
    assert status == 401, body
    assert body["error"]["type"] == "AuthenticationError"  # type: ignore[index]
    assert headers[b"x-request-id"] != b"from-the-trailer"
    # the same request with the key in its headers is served: the refusal is the trailer's
    served = request.replace(b"Host: x\r\n", b"Host: x\r\nAuthorization: Bearer %s\r\n"
                             % key.encode())
    assert answer(exchange(port, served))[0] == 200


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/0.9"])
def test_edge_a_request_line_of_another_http_version_is_refused(
    edge: tuple[int, str], version: bytes,
) -> None:
    """A request line naming HTTP/2.0 or HTTP/0.9 is not served as HTTP/1.1 (a proxy in
    front could frame it otherwise): a 505 in OpenAI's shape, and the connection closes, the
    request pipelined after it unanswered."""
    port, key = edge
    get = b"GET /v1/models %s\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n"
    raw = exchange(port, get % (version, key.encode()) + get % (b"HTTP/1.1", key.encode()))
    status, headers, body = answer(raw)
    assert status == 505, raw
    assert headers[b"connection"] == b"close"
    assert body["error"]["type"] == "HTTPVersionNotSupportedError"  # type: ignore[index]
    assert b"HTTP/1.1 200" not in raw


@pytest.mark.parametrize("sent", ["a b", "a\tb", "x tenant=other status=200"])
def test_edge_a_request_id_with_whitespace_is_replaced(edge: tuple[int, str], sent: str) -> None:
    """An X-Request-Id with spaces or tabs is not taken (it would write fields of the client's
    choosing into a text request log line): the answer carries a new one, 32 hex digits."""
    port, key = edge
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=CHAT, timeout=30,
                      headers={"Authorization": f"Bearer {key}", "x-request-id": sent,
                               "content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    rid = resp.headers["x-request-id"]
    assert rid != sent and len(rid) == 32 and int(rid, 16) >= 0
    assert sent not in resp.json()["id"]


BOUND = 1024 * 1024  # server.max_pending_body_bytes of the `tenants` gateway


@pytest.fixture(scope="module")
def tenants() -> Iterator[tuple[int, str, str]]:
    """(the port of a gateway whose bodies still arriving are bounded to `BOUND` bytes, a
    key of tenant a, one of tenant b)."""
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"m": {"default": "p"}},
              "server": {"max_pending_body_bytes": BOUND, "max_body_bytes": 450_000},
              "tenants": [{"id": "a", "tier": "default"}, {"id": "b", "tier": "default"}]}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    with sim:
        gw, base = gateway_proc(config=config, env=env, auth=True)
        with gw, admin_client(base, ADMIN) as admin:
            keys = [admin.post(f"/tenants/{t}/keys").json()["key"] for t in ("a", "b")]
            yield int(base.rsplit(":", 1)[1]), keys[0], keys[1]


def padded(size: int) -> bytes:
    """A chat request of `size` bytes (its `user` field pads it)."""
    head = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"user":"'
    return head + b"u" * (size - len(head) - 2) + b'"}'


def upload(port: int, key: str, body: bytes, sent: int) -> socket.socket:
    """A POST of `body` whose first `sent` bytes are written, the rest held back."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (key.encode(), len(body), body[:sent]))
    return sock


def refused(port: int, key: str, sock: socket.socket) -> bool:
    """Whether the gateway has answered `sock`'s unfinished upload. A whole request of the
    same tenant is answered first: its round trip to the replica takes the gateway's loop
    past the upload's bytes already read (and a refusal of them, written at once)."""
    chat = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=CHAT,
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert chat.status_code == 200, chat.text
    sock.setblocking(False)
    try:
        got = sock.recv(65536)
    except BlockingIOError:
        return False
    finally:
        sock.setblocking(True)
    assert got.startswith(b"HTTP/1.1 503 "), got
    return True


def test_edge_one_tenants_slow_uploads_leave_room_for_the_others(
    tenants: tuple[int, str, str],
) -> None:
    """Tenant a's uploads held unfinished (a slow or stalled sender) fill at most half of
    `server.max_pending_body_bytes`: its next one is the 503, and tenant b's body, arriving in
    parts meanwhile, is still read and served (it got the 503 while a's filled the bound)."""
    port, key_a, key_b = tenants
    body = padded(400_000)
    held: list[socket.socket] = []
    try:
        for _ in range(6):
            held.append(upload(port, key_a, body, 300_000))
            if refused(port, key_a, held[-1]):
                break
        else:
            raise AssertionError("tenant a's uploads were never refused")
        late = upload(port, key_b, body, 300_000)
        held.append(late)
        assert not refused(port, key_b, late)
        late.sendall(body[300_000:])
        late.settimeout(30)
        assert late.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in held:
            sock.close()


def test_edge_an_http_0_9_request_is_refused_at_its_line_end(edge: tuple[int, str]) -> None:
    """HTTP/0.9's request (a line without a version, then nothing) is answered as soon as its
    line ends, a 505, not left waiting for headers that never come (a 408 at the header
    timeout)."""
    port, _ = edge
    status, headers, body = answer(exchange(port, b"GET /healthz\r\n"))
    assert headers[b"connection"] == b"close"
    assert status == 505, body
    assert body["error"]["message"].startswith("HTTP/0.9 is not supported")  # type: ignore[index]
