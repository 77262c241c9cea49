"""Deeply nested JSON against a real gateway: a 400 in OpenAI's shape before any work, on the
proxied routes (nothing reaches the replica) and on the admin API (nothing is created)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "admin-token-0123456789abcdef"


def nested(depth: int) -> object:
    value: object = 1
    for i in range(depth - 1):
        value = {"k": value} if i % 2 else [value]
    return value


def raw_nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


def test_deep_json_is_400_before_any_work(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], auth=True,
                            env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "acme", "tier": "default"}).status_code == 201
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        for depth in (200, 300):  # (the SDK's own JSON encoder stops near 1000)
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="sim-model", prompt="x", max_tokens=1,
                                          extra_body={"vllm_xargs": nested(depth)})
            assert "deeper than" in err.value.message
        r = httpx.post(f"{base}/v1/completions", headers={"authorization": f"Bearer {key}"},
                       content=b'{"model": "sim-model", "prompt": "x", "x": '
                       + raw_nested(1000) + b"}")
        assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"]
        assert httpx.get(f"{sim}/sim/stats").json()["received"] == 0  # never forwarded
        ok = client.completions.create(model="sim-model", prompt="x", max_tokens=1,
                                       extra_body={"vllm_xargs": nested(20)})
        assert ok.choices

        for method, path, body in (
            ("POST", "/tenants", b'{"id": "deep", "tier": "default", "limits": '
             + raw_nested(300) + b"}"),
            ("POST", "/tenants", b'{"id": "deep", "tier": "default", "limits": '
             + raw_nested(5000) + b"}"),
            ("PUT", "/policy", b'{"pools": ' + raw_nested(300) + b"}"),
        ):
            r = admin.request(method, path, content=body,
                              headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            assert r.headers["content-type"].startswith("application/json")
            assert "deeper than" in r.json()["error"]["message"]
        assert admin.get("/tenants/deep").status_code == 404  # nothing was created


def _raw_post(port: int, body: bytes, *, declared: bool,
              token: str | None = ADMIN) -> tuple[bytes, dict[str, Any]]:
    """POST `body` to /admin/tenants with a Content-Length or chunked, with the admin `token`
    (None: without authentication): (status line and headers, the error object of the
    answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        # keep-alive: the server reads (and drops) what follows its early answer
        head = b"POST /admin/tenants HTTP/1.1\r\nhost: x\r\n"
        if token is not None:
            head += f"authorization: Bearer {token}\r\n".encode()
        if declared:
            s.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        else:
            s.sendall(head + b"transfer-encoding: chunked\r\n\r\n")
            for i in range(0, len(body), 10_000):
                part = body[i:i + 10_000]
                s.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        raw = b""
        while b"}}" not in raw and (chunk := s.recv(65536)):
            raw += chunk
    head_out, _, answer = raw.partition(b"\r\n\r\n")
    error: dict[str, Any] = orjson.loads(answer)["error"]
    return head_out, error


def test_admin_body_over_the_limit_is_413_before_it_is_read() -> None:
    """The admin API's JSON guard reads a body before the admin app parses it: without a
    bound, one upload would be buffered whole (and copied while checked)."""
    gw, base = gateway_proc(upstreams=["http://127.0.0.1:9"], ready=False, env={
        "KVGATE_ADMIN_TOKEN": ADMIN, "KVGATE_SERVER__MAX_BODY_BYTES": "100000"})
    with gw:
        port = int(base.rsplit(":", 1)[1])
        big = b'{"id": "x", "pad": "' + b"a" * 200_000 + b'"}'
        for declared in (True, False):  # a Content-Length, or a chunked upload
            head, err = _raw_post(port, big, declared=declared)
            assert head.startswith(b"HTTP/1.1 413"), head
            assert err["type"] == "RequestEntityTooLargeError" and "100000 bytes" in err["message"]
        with admin_client(base, ADMIN) as admin:  # a body within the limit still gets through
            r = admin.post("/tenants", json={"id": "ok", "tier": "default"})
            assert r.status_code == 201, r.text


@pytest.mark.parametrize("token", [None, "wrong-token-" + "x" * 20, "kvg-" + "a" * 43],
                         ids=["no-token", "wrong-token", "tenant-key"])
def test_an_admin_body_without_a_valid_admin_token_is_refused_unread(
    token: str | None,
) -> None:
    """The body used to be read (up to 1 MiB, waiting for all of it) before the admin token
    was checked: anonymous callers made the gateway buffer a MiB per connection, and one
    that declared a body and sent none had no answer until the body timeout. Now the
    refusal comes at once, before a byte of the body is sent; the body, sent afterwards on
    the same connection, is dropped and the next request on it is answered."""
    gw, base = gateway_proc(upstreams=["http://127.0.0.1:9"], ready=False,
                            env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, socket.create_connection(
            ("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=5) as s:
        body = b'{"id": "x", "pad": "' + b"a" * 500_000 + b'"}'
        auth = b"" if token is None else f"authorization: Bearer {token}\r\n".encode()
        s.sendall(b"POST /admin/tenants HTTP/1.1\r\nhost: x\r\n" + auth
                  + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        raw = b""
        while b"}}" not in raw and (chunk := s.recv(65536)):  # (times out after 5 s)
            raw += chunk
        assert raw.split(b" ", 2)[1] in (b"401", b"403"), raw[:200]
        s.sendall(body + b"GET /admin/tenants HTTP/1.1\r\nhost: x\r\n"
                  b"authorization: Bearer " + ADMIN.encode() + b"\r\n\r\n")
        raw = b""
        while b"HTTP/1.1 200" not in raw and (chunk := s.recv(65536)):
            raw += chunk
        assert b"HTTP/1.1 200" in raw
        with admin_client(base, ADMIN) as admin:
            assert admin.get("/tenants/x").status_code == 404  # nothing was created


def test_admin_bodies_stop_at_1_mib_and_a_throttled_address_gets_429_unread() -> None:
    """Below server.max_body_bytes (8 MiB) the admin API has its own 1 MiB bound; an address
    throttled for failed authentications is refused before its body is read."""
    gw, base = gateway_proc(upstreams=["http://127.0.0.1:9"], ready=False,
                            env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw:
        port = int(base.rsplit(":", 1)[1])
        big = b'{"id": "x", "pad": "' + b"a" * 2_000_000 + b'"}'
        for declared in (True, False):
            head, err = _raw_post(port, big, declared=declared)
            assert head.startswith(b"HTTP/1.1 413"), head
            assert "1048576 bytes" in err["message"]
        with admin_client(base, "wrong-token-" + "x" * 20) as attacker:
            for _ in range(10):  # the address's budget of failures
                assert attacker.get("/tenants").status_code == 401
        for declared in (True, False):
            head, err = _raw_post(port, big, declared=declared, token=None)
            assert head.startswith(b"HTTP/1.1 429") and b"retry-after:" in head.lower(), head
            assert err["type"] == "RateLimitError"


def test_integers_beyond_64_bits_are_400_and_others_pass_unchanged(
    sim_factory: SimFactory,
) -> None:
    """orjson reads an integer beyond 64 bits as a float: forwarded, `seed` would have become
    1.2345678901234568e+29. It is a 400 naming the problem; 64-bit ones (and long digit runs
    inside strings, and long fractions) reach the replica exactly as sent."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_ADMIN_TOKEN": ADMIN})
    head = b'{"model": "sim-model", "prompt": "x", "max_tokens": 1, '
    with gw, admin_client(base, ADMIN) as admin:
        explain = admin.post("/route/explain", content=b'{"tier": "default", "request": '
                             + head + b'"seed": 123456789012345678901234567890}}')
        assert explain.status_code == 400, explain.text  # was a 500 with a traceback
        assert "integer beyond 64 bits" in explain.json()["error"]["message"]
        for field in (b'"seed": 123456789012345678901234567890',
                      b'"seed": -9223372036854775809', b'"seed": 18446744073709551616',
                      b'"vllm_xargs": {"a": [1, 100000000000000000000000]}'):
            r = httpx.post(f"{base}/v1/completions", content=head + field + b"}")
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "BadRequestError"
            assert "integer beyond 64 bits" in error["message"], error
        r = httpx.post(f"{base}/v1/completions", content=head + b'"max_tokens": 1e400}')
        assert r.status_code == 400 and "infinity" in r.json()["error"]["message"]
        assert httpx.get(f"{sim}/sim/stats").json()["received"] == 0  # nothing forwarded
        for field, value in ((b'"seed": 18446744073709551615', 18446744073709551615),
                             (b'"seed": -9223372036854775808', -9223372036854775808),
                             (b'"user": "12345678901234567890123456789"',
                              "12345678901234567890123456789"),
                             (b'"temperature": 0.123456789012345678901', 0.123456789012345678901)):
            r = httpx.post(f"{base}/v1/completions", content=head + field + b"}")
            assert r.status_code == 200, r.text
            sent = httpx.get(f"{sim}/sim/requests?n=1").json()["requests"][0]["body"]
            assert sent[field.split(b'"')[1].decode()] == value


def test_route_explain_takes_a_prompt_as_long_as_the_proxy_does(sim_factory: SimFactory) -> None:
    """Explaining a request with a long prompt is legitimate: with a valid admin token
    `/admin/route/explain` reads bodies up to `server.max_body_bytes`; on the other admin routes
    the 1 MiB bound stays; without a valid token the body is not read at all (401)."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_ADMIN_TOKEN": ADMIN})
    prompt = "word " * 400_000  # 2 MB
    body = {"tier": "default", "request": {"model": "sim-model", "prompt": prompt}}
    with gw, admin_client(base, ADMIN) as admin, admin_client(base, None) as anonymous:
        r = admin.post("/route/explain", json=body)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["prompt_tokens"] >= 400_000
        over = admin.post("/route/explain", json={**body, "pad": "a" * 7_000_000})
        assert over.status_code == 413 and "8388608 bytes" in over.json()["error"]["message"]
        r = anonymous.post("/route/explain", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = admin.post("/tenants", json={"id": "big", "tier": "default", "pad": prompt})
        assert r.status_code == 413 and "1048576 bytes" in r.json()["error"]["message"]
