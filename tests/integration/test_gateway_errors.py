"""Errors: kvgate's own are OpenAI-shaped with the right status; upstream errors pass through."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import sim_proc

MODEL = "sim-model"


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, str]]:
    sim, url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        proc, base = gateway_proc(upstreams=[url], env={"KVGATE_SERVER__MAX_BODY_BYTES": "4096"})
        with proc:
            yield base, url


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> None:
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert "Traceback" not in err["message"]


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2, 3]", 400, None),
        (b'{"model": true, "messages": []}', 400, "model"),  # (none: vLLM's own, served)
        (b'{"model": 42, "messages": []}', 400, "model"),
        (b'{"model": "sim-model", "stream": "maybe", "messages": []}', 400, "stream"),
        (b'{"model": "no-such-model", "messages": []}', 404, "model"),
        (b'{"model": "sim-model", "prompt": "' + b"x" * 5000 + b'"}', 413, None),
    ],
)
def test_bad_inputs(gw: tuple[str, str], content: bytes, status: int, param: str | None) -> None:
    base, _ = gw
    resp = httpx.post(f"{base}/v1/chat/completions", content=content,
                      headers={"Content-Type": "application/json", "X-Request-Id": "bad-1"})
    assert_openai_error(resp, status, param)
    assert resp.headers["x-request-id"] == "bad-1"


def test_huge_chunked_body_is_413(gw: tuple[str, str]) -> None:
    base, _ = gw

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "sim-model", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    resp = httpx.post(f"{base}/v1/completions", content=chunks())
    assert_openai_error(resp, 413)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/reset_prefix_cache", 404),
        ("POST", "/sleep", 404),
        ("POST", "/collective_rpc", 404),
        ("GET", "/start_profile", 404),
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
    ],
)
def test_unsupported_paths(gw: tuple[str, str], method: str, path: str, status: int) -> None:
    base, _ = gw
    resp = httpx.request(method, f"{base}{path}")
    assert_openai_error(resp, status)
    if status == 405:  # RFC 9110: a 405 lists the methods the path does allow
        assert resp.headers["allow"] == ("POST" if path.endswith("completions") else "GET, HEAD")


def test_an_api_path_without_v1_is_pointed_at_it(gw: tuple[str, str]) -> None:
    base, _ = gw
    for path in ("/chat/completions", "/models", "/responses/resp_1"):
        resp = httpx.post(f"{base}{path}", json={})
        assert_openai_error(resp, 404)
        assert resp.json()["error"]["message"] == (
            f"Unknown path {path}. Did you mean /v1{path}? (the base URL ends in /v1)")
    assert httpx.post(f"{base}/sleep").json()["error"]["message"] == "Unknown path /sleep."


def test_an_unknown_model_lists_the_public_names(gw: tuple[str, str]) -> None:
    base, sim_url = gw
    resp = httpx.post(f"{base}/v1/chat/completions", json={"model": "nope", "messages": []})
    assert_openai_error(resp, 404, "model")
    assert resp.json()["error"]["message"] == (
        "The model `nope` does not exist. Models served here: sim-model (GET /v1/models lists "
        "them).")
    # public names of their own: the served name that answers carry is not one of them
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [sim_url]}},
              "models": {f"public-{i:02}": {"default": "p"} for i in range(12)}}
    proc, other = gateway_proc(config=config)
    with proc:
        resp = httpx.post(f"{other}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert_openai_error(resp, 404, "model")
    message = resp.json()["error"]["message"]
    assert message.startswith(
        "The model `sim-model` does not exist. `sim-model` is the name a replica serves it "
        "under (answers carry it in `model`); send the public model name instead.")
    assert message.endswith(f"Models served here: {', '.join(f'public-{i:02}' for i in range(10))}"
                            " and 2 more (GET /v1/models lists them).")


def test_a_model_of_other_tiers_is_said_not_offered_not_missing(gw: tuple[str, str]) -> None:
    _, sim_url = gw
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [sim_url]}},
              "models": {"open": {"default": "p"}, "premium-only": {"premium": "p"}},
              "tiers": {"default": {}, "premium": {}}}
    proc, base = gateway_proc(config=config)  # no auth: every caller is of the default tier
    with proc:
        resp = httpx.post(f"{base}/v1/chat/completions",
                          json={"model": "premium-only", "messages": []})
    assert_openai_error(resp, 404, "model")
    assert resp.json()["error"]["message"] == (
        "The model `premium-only` is not offered to this key's tier (`default`). Models served "
        "here: open (GET /v1/models lists them).")


def test_openai_client_error_classes(gw: tuple[str, str]) -> None:
    base, _ = gw
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):  # the replica's own validation, passed through
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                  max_tokens=-5)


@pytest.mark.parametrize("status", [500, 503])
def test_upstream_errors_keep_status_and_body(gw: tuple[str, str], status: int) -> None:
    base, sim = gw
    httpx.post(f"{sim}/sim/faults", json={"error_rate": 1.0, "error_status": status})
    try:
        direct = httpx.post(f"{sim}/v1/completions", json={"model": MODEL, "prompt": "x"})
        via = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"})
    finally:
        httpx.post(f"{sim}/sim/faults", json={"error_rate": 0.0, "error_status": 500})
    assert via.status_code == direct.status_code == status
    assert via.json() == direct.json()
