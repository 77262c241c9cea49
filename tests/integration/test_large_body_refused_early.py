"""A large body from a caller that is refused anyway is refused before it is read: no API key
(401) or a tenant over its limit (429) gets its answer while the upload is still under way, so
it never reaches the few worker threads that parse large bodies (`gateway.prepare.OffLoop`)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import httpx
import pytest

from gateway.prepare import OFF_LOOP_BYTES
from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "early-admin-token-0123456789"
SIZE = 4 * OFF_LOOP_BYTES


def _first_answer_before_the_body(port: int, key: str | None) -> bytes:
    """Send the headers of a large chat request and a small part of its body, then wait
    (the rest never comes): the status line of the answer, or b"" when none came."""
    auth = b"authorization: Bearer " + key.encode() + b"\r\n" if key else b""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + auth + b"content-length: " + str(SIZE).encode() + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + b'{"model": "llama", "messages": [')
        sock.settimeout(3)
        try:
            return sock.recv(65536).split(b"\r\n", 1)[0]
        except TimeoutError:
            return b""


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_callers_refused_anyway_get_their_answer_before_the_body(
    sim_factory: SimFactory, store: str
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    config = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"rpm": 1}}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url if store == "redis" else ""}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    port = int(base.rsplit(":", 1)[1])
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        assert _first_answer_before_the_body(port, None) == b"HTTP/1.1 401 Unauthorized"
        # the minute's one request, then a large body over the limit
        ok = httpx.post(f"{base}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                        json={"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200, ok.text
        assert _first_answer_before_the_body(port, key) == b"HTTP/1.1 429 Too Many Requests"
        # a whole large body over the limit gets the same answer, with its headers
        big = httpx.post(f"{base}/v1/chat/completions",
                         headers={"authorization": f"Bearer {key}"},
                         content=b'{"model": "llama", "messages": []}'.ljust(SIZE), timeout=10)
        assert big.status_code == 429
        assert big.json()["error"]["type"] == "RateLimitError"
        assert big.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(big.headers["retry-after"]) >= 1
