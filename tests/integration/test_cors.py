"""CORS for browser clients (gateway/cors.py): preflights answered by kvgate itself, the
allow headers on every answer to an allowed `Origin` (streams, errors, kvgate's own pages),
none for other origins, off with an empty origin list, a bad origin refused at start."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from tests.support.gateway import AUTH_SECRET, gateway_proc
from tests.support.procs import KVGATE, ROOT, Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
APP = "https://app.example"
CHAT = "/v1/chat/completions"
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3}
PREFLIGHT = {"origin": APP, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type, x-stainless-os"}


def _sim_count(sim: str) -> int:
    return len(httpx.get(f"{sim}/sim/requests?n=10000").json()["requests"])


def _requests_total(client: httpx.Client) -> str:
    return "\n".join(line for line in client.get("/metrics").text.splitlines()
                     if line.startswith("kvgate_requests_total"))


def _pool(sim: str) -> dict[str, object]:
    return {"pools": {"p": {"served_model": "sim-model", "replicas": [sim]}}}


def test_any_origin_by_default(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw, httpx.Client(base_url=base, timeout=10) as client:
        before, counted = _sim_count(sim), _requests_total(client)
        for path in (CHAT, "/v1/responses", "/v1/models", "/v1/responses/resp_x"):
            pre = client.options(path, headers=PREFLIGHT)
            assert (pre.status_code, pre.content) == (204, b""), (path, pre.text)
            assert pre.headers["access-control-allow-origin"] == "*"
            assert pre.headers["access-control-allow-methods"] == "POST"
            assert pre.headers["access-control-allow-headers"] == PREFLIGHT[
                "access-control-request-headers"]
            assert pre.headers["access-control-max-age"] == "600"
        # never forwarded, not a request in the metrics
        assert (_sim_count(sim), _requests_total(client)) == (before, counted)

        # a stream's head carries the headers; the chunks are relayed as ever
        with client.stream("POST", CHAT, json={**BODY, "stream": True},
                           headers={"origin": APP}) as r:
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "*"
            exposed = r.headers["access-control-expose-headers"].split(", ")
            assert {"x-request-id", "retry-after", "x-ratelimit-remaining-requests",
                    "x-kvgate-replica", "x-kvgate-route"} <= set(exposed)
            assert "vary" not in r.headers
            assert b"data: [DONE]" in r.read()
        # errors: an unknown model (before any replica), a wrong method, an unknown path
        for r in (client.post(CHAT, json={**BODY, "model": "nope"}, headers={"origin": APP}),
                  client.get(CHAT, headers={"origin": APP}),
                  client.get("/chat/completions", headers={"origin": APP})):
            assert r.status_code in (404, 405), r.text
            assert r.headers["access-control-allow-origin"] == "*", r.request.url
        models = client.get("/v1/models", headers={"origin": APP})
        assert models.headers["access-control-allow-origin"] == "*"
        # without Origin: no CORS header at all
        plain = client.post(CHAT, json=BODY)
        assert plain.status_code == 200
        assert not [k for k in plain.headers if k.startswith("access-control-")]
        # an OPTIONS request that is not a preflight is answered as before
        assert client.options(CHAT).status_code == 405
        # the admin API never answers CORS
        admin = client.options("/admin/tenants", headers=PREFLIGHT)
        assert "access-control-allow-origin" not in admin.headers


def test_listed_origins_only(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    config = {**_pool(sim), "server": {"cors_allowed_origins": [APP, "http://localhost:3000"],
                                       "cors_allowed_headers": ["authorization",
                                                                "content-type"]}}
    gw, base = gateway_proc(config=config, auth=True,
                            env={"KVGATE_SALT_SECRET": AUTH_SECRET})
    with gw, httpx.Client(base_url=base, timeout=10) as client:
        before = _sim_count(sim)
        pre = client.options(CHAT, headers=PREFLIGHT)  # no key needed
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == APP
        assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
        assert "origin" in pre.headers["vary"]
        # a 401 (no key) and a 401 on a stream request: the echoed origin, Vary
        for body in (BODY, {**BODY, "stream": True}):
            r = client.post(CHAT, json=body, headers={"origin": APP})
            assert r.status_code == 401
            assert r.headers["access-control-allow-origin"] == APP
            assert r.headers["vary"] == "origin"
            assert "x-request-id" in r.headers["access-control-expose-headers"]
        # an origin not listed: no CORS headers, the request served as any other
        evil = {**PREFLIGHT, "origin": "https://evil.example"}
        refused = client.options(CHAT, headers=evil)
        assert refused.status_code == 405
        assert "access-control-allow-origin" not in refused.headers
        r = client.post(CHAT, json=BODY, headers={"origin": "https://evil.example"})
        assert r.status_code == 401
        assert not [k for k in r.headers if k.startswith("access-control-")]
        assert _sim_count(sim) == before


def test_an_empty_origin_list_turns_cors_off(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(config={**_pool(sim), "server": {"cors_allowed_origins": []}})
    with gw, httpx.Client(base_url=base, timeout=10) as client:
        pre = client.options(CHAT, headers=PREFLIGHT)
        assert (pre.status_code, pre.headers["allow"]) == (405, "POST")  # as without CORS
        assert client.options("/v1/models", headers=PREFLIGHT).status_code == 405
        assert client.options("/nowhere", headers=PREFLIGHT).status_code == 404
        r = client.post(CHAT, json=BODY, headers={"origin": APP})
        assert r.status_code == 200
        assert not [k for k in r.headers if k.startswith("access-control-")]


def test_origins_from_the_environment(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    env = {"KVGATE_SERVER__CORS_ALLOWED_ORIGINS": f"{APP}, http://localhost:3000"}
    gw, base = gateway_proc(upstreams=[sim], env=env)
    with gw, httpx.Client(base_url=base, timeout=10) as client:
        ok = client.options(CHAT, headers={**PREFLIGHT, "origin": "http://localhost:3000"})
        assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = client.options(CHAT, headers={**PREFLIGHT, "origin": "http://localhost:3001"})
        assert "access-control-allow-origin" not in other.headers


def test_a_bad_origin_is_refused_at_start(tmp_path: Path) -> None:
    for origins, why in (([8080], "cors_allowed_origins.0: Input should be a valid string"),
                         (["https://app.example/"], "is not an origin"),
                         (["*", APP], "list it alone")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({
            "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
            "server": {"cors_allowed_origins": origins}}))
        result = subprocess.run(
            [*KVGATE, "serve", "--no-auth", "--config", str(path), "--port", str(free_port())],
            cwd=ROOT, capture_output=True, text=True, timeout=30,
            env={"PATH": "/usr/bin:/bin"})
        assert result.returncode == 2, result.stderr
        assert "server." in result.stderr and why in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
