"""One `type` vocabulary for every error kvgate answers (issue 10, item 11): the proxied
routes, kvgate's own pages, the admin API, the HTTP guard and upstream errors kvgate re-shapes
all say the same `type` for the same status, and that type is the one OpenAI's SDK and vLLM
use (e.g. 404 NotFoundError, 429 RateLimitError); each body is OpenAI's shape."""

from __future__ import annotations

import socket
from collections import defaultdict
from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "vocabulary-admin-token-0123456789"
VOCABULARY = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 405: "MethodNotAllowedError", 412: "PreconditionFailedError",
    413: "RequestEntityTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
    502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError",
}


def raw_request(port: int, head: bytes) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request written by hand (headers httpx would refuse)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_part, _, body = data.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), body


def test_every_error_uses_one_type_per_status(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
        "KVGATE_SERVER__MAX_BODY_BYTES": "4096", "KVGATE_SERVER__MAX_HEADER_BYTES": "8192"})
    seen: dict[int, set[str]] = defaultdict(set)
    where: dict[tuple[int, str], str] = {}

    def record(what: str, resp: httpx.Response, status: int) -> None:
        assert resp.status_code == status, (what, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}, (what, err)
        seen[status].add(err["type"])
        where.setdefault((status, err["type"]), what)

    with gw, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "t", "tier": "default",
                                            "limits": {"rpm": 1}}).status_code == 201
        assert admin.post("/tenants", json={"id": "u", "tier": "default"}).status_code == 201
        limited = {"Authorization": f"Bearer {admin.post('/tenants/t/keys').json()['key']}"}
        auth = {"Authorization": f"Bearer {admin.post('/tenants/u/keys').json()['key']}"}
        v1 = f"{base}/v1/completions"
        ok = {"model": "sim-model", "prompt": "x", "max_tokens": 2}
        record("no key", httpx.post(v1, json=ok), 401)
        record("bad json", httpx.post(v1, content=b"{no", headers=auth), 400)
        record("unknown model", httpx.post(v1, json={**ok, "model": "nope"}, headers=auth), 404)
        record("unknown path", httpx.post(f"{base}/v1/nope", json=ok, headers=auth), 404)
        record("method", httpx.get(v1, headers=auth), 405)
        record("body", httpx.post(v1, json={**ok, "prompt": "x" * 5000}, headers=auth), 413)
        record("upstream 400", httpx.post(v1, json={**ok, "n": 0}, headers=auth), 400)
        assert httpx.post(v1, json=ok, headers=limited).status_code == 200
        record("rate limit", httpx.post(v1, json=ok, headers=limited), 429)
        record("admin no token", httpx.get(f"{base}/admin/tenants"), 401)
        record("admin tenant key", httpx.get(f"{base}/admin/tenants", headers=auth), 403)
        record("admin unknown tenant", admin.get("/tenants/ghost"), 404)
        record("admin unknown path", admin.get("/nope"), 404)
        record("admin method", admin.delete("/policy"), 405)
        record("admin bad body", admin.post("/tenants", json={"id": 5}), 400)
        record("admin stale", admin.put("/policy", json=admin.get("/policy").json(),
                                          headers={"If-Match": '"999"'}), 412)
        httpx.post(f"{sim}/sim/faults", json={"error_rate": 1.0, "error_status": 500})
        record("upstream 500", httpx.post(v1, json=ok, headers=auth), 500)
        httpx.post(f"{sim}/sim/faults", json={"error_rate": 1.0, "error_status": 503})
        record("upstream 503", httpx.post(v1, json=ok, headers=auth), 503)
        port = int(base.rsplit(":", 1)[1])
        status, body = raw_request(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: "
                                   + b"a" * 20000 + b"\r\n\r\n")
        assert status == 431
        err = httpx.Response(status, content=body).json()["error"]
        seen[status].add(err["type"])
        where.setdefault((status, err["type"]), "huge header")
    several = {s: (types, [where[(s, t)] for t in types]) for s, types in seen.items()
               if len(types) > 1}
    assert not several, f"one status, several types: {several}"
    for status, types in seen.items():
        if status in VOCABULARY:
            assert types == {VOCABULARY[status]}, (status, types, where)
