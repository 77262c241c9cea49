"""A request that names no model, as curl scripts written against one vLLM send them: vLLM's
request models make `model` optional (absent, null or "" is the model it serves), so kvgate
serves it with the one model the key can use, and answers a key that can use several a 400
listing them. A real gateway (authentication on), one simulated replica, two tiers; and the
picker behind a real Envoy (the quick form), which prepares requests the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.support.edges import running_edge
from tests.support.gateway import gateway_proc, two_tier_gateway
from tests.support.procs import sim_proc

ADMIN = "model-omitted-admin-0123456789"
ROUTES: dict[str, dict[str, Any]] = {
    "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "completions": {"prompt": "hi", "max_tokens": 2},
    "embeddings": {"input": "hi"},
    "responses": {"input": "hi", "max_output_tokens": 2},
}


@pytest.fixture(scope="module")
def keys() -> Iterator[tuple[str, dict[str, str]]]:
    """(gateway base URL, {"one": a key whose tier has one model, "two": one with two,
    "sim": the replica's URL})."""
    with two_tier_gateway("gold-only", ADMIN) as (base, keys):
        yield base, {"one": keys["default"], "two": keys["premium"], "sim": keys["sim"]}


def _post(base: str, key: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/v1/{route}", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("model", ["absent", None, ""])
def test_no_model_is_the_one_the_key_can_use(
    keys: tuple[str, dict[str, str]], route: str, model: str | None,
) -> None:
    base, made = keys
    body = dict(ROUTES[route]) if model == "absent" else {**ROUTES[route], "model": model}
    httpx.delete(f"{made['sim']}/sim/requests")
    answer = _post(base, made["one"], route, body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sim-model"  # (answers name the served model)
    sent = httpx.get(f"{made['sim']}/sim/requests", params={"n": 1}).json()["requests"]
    assert sent[0]["body"]["model"] == "sim-model"
    assert "cache_salt" in sent[0]["body"]  # planned as a request for `open`: the tenant's salt


def test_a_key_with_several_models_is_told_to_name_one(
    keys: tuple[str, dict[str, str]],
) -> None:
    base, made = keys
    answer = _post(base, made["two"], "chat/completions", ROUTES["chat/completions"])
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["param"], error["code"], error["type"]) == ("model", 400, "BadRequestError")
    assert error["message"] == ("`model` is required: this key can use 2 models "
                                "(gold-only, open; GET /v1/models lists them).")
    # a model of the wrong type is still kvgate's 400 naming it
    wrong = _post(base, made["one"], "completions", {**ROUTES["completions"], "model": 7})
    assert (wrong.status_code, wrong.json()["error"]["param"]) == (400, "model")


def test_the_picker_behind_envoy_serves_it_too(sim_factory: Callable[..., Any]) -> None:
    _, url = sim_factory("--time-scale", "50")
    with running_edge("envoy", upstreams=[url]) as (base, _):
        answer = httpx.post(f"{base}/v1/completions", json=ROUTES["completions"], timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sim-model"


def test_before_the_quick_form_knows_its_model_it_is_the_503_to_retry() -> None:
    _, url = sim_proc(None, model="sim-model")  # (never started: no replica answers yet)
    gw, base = gateway_proc(upstreams=[url], ready=False)
    with gw:
        answer = httpx.post(f"{base}/v1/completions", json=ROUTES["completions"], timeout=30)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["message"] == ("No ready replica: no model is known yet to "
                                                 "serve a request that names none.")
