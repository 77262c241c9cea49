"""vLLM's tokenizer and pooling routes through kvgate: ``/tokenize``, ``/detokenize``,
``/pooling``, ``/classify``, the score and rerank routes, as RAG platforms and tooling call
them (the official openai client's ``post``, httpx). Each is served by a replica of the
tenant's pool under the served model's name, with the tenant's salt only where vLLM's
request has the field (a client's never), kvgate's errors OpenAI-shaped, and the in-flight
count back to 0. A real gateway (authentication on) before one simulated replica."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import inflight, request_statuses, two_tier_gateway, wait_for

ADMIN = "routes-pooling-admin-0123456789"
# route -> (a body, whether vLLM's request for it takes `cache_salt`)
ROUTES: dict[str, tuple[dict[str, Any], bool]] = {
    "/tokenize": ({"prompt": "hello there"}, False),
    "/detokenize": ({"tokens": [1, 2, 3]}, False),
    "/pooling": ({"input": "hello there"}, True),
    "/classify": ({"input": ["good", "bad"]}, True),
    "/score": ({"text_1": "a question", "text_2": ["x", "y"]}, True),
    "/v1/score": ({"text_1": "a question", "text_2": "x"}, True),
    "/rerank": ({"query": "q", "documents": ["a", "b", "c"]}, True),
    "/v1/rerank": ({"query": "q", "documents": ["a", "b"], "top_n": 1}, True),
    "/v2/rerank": ({"query": "q", "documents": [{"text": "a"}]}, True),
}


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _last_sent(sim: str) -> dict[str, Any]:
    sent: dict[str, Any] = httpx.get(f"{sim}/sim/requests", params={"n": 1}).json()[
        "requests"][0]
    return sent


@pytest.mark.parametrize("route", ROUTES)
def test_each_route_is_served_with_the_salt_where_vllm_takes_it(
    gw: tuple[str, dict[str, str]], route: str,
) -> None:
    base, keys = gw
    body, salted = ROUTES[route]
    # (the base URL without /v1: half of these routes are not under it)
    client = openai.OpenAI(base_url=base, api_key=keys["default"], max_retries=0)
    httpx.delete(f"{keys['sim']}/sim/requests")
    raw = client.post(route, body={**body, "model": "open", "cache_salt": "not-mine"},
                      cast_to=httpx.Response)
    assert raw.status_code == 200
    assert raw.headers["x-kvgate-replica"]
    sent = _last_sent(keys["sim"])
    assert sent["path"] == route
    assert sent["body"]["model"] == "sim-model"
    if salted:
        assert sent["body"]["cache_salt"] not in ("", "not-mine")
    else:
        assert "cache_salt" not in sent["body"]
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_rerank_answer_is_the_replicas(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    answer = httpx.post(f"{base}/v1/rerank", timeout=30,
                        headers={"Authorization": f"Bearer {keys['default']}"},
                        json={"model": "open", "query": "q", "documents": ["a", "b", "c"]})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)


def test_tokenize_without_a_model_is_the_one_the_key_can_use(
    gw: tuple[str, dict[str, str]],
) -> None:
    base, keys = gw
    answer = httpx.post(f"{base}/tokenize", json={"prompt": "a b c"}, timeout=30,
                        headers={"Authorization": f"Bearer {keys['default']}"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["count"] > 0


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "no-such-model", "query": "q", "documents": ["a"]}, 404, "model"),
    ({"model": "gold-only", "query": "q", "documents": ["a"]}, 404, "model"),  # other tier's
    ({"model": 7, "query": "q", "documents": ["a"]}, 400, "model"),
])
def test_bad_input_is_an_openai_shaped_error(
    gw: tuple[str, dict[str, str]], body: dict[str, Any], status: int, param: str,
) -> None:
    base, keys = gw
    before = request_statuses(base).get(str(status), 0)
    answer = httpx.post(f"{base}/rerank", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {keys['default']}"})
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["param"] == param and error["message"]
    assert request_statuses(base).get(str(status), 0) == before + 1
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


@pytest.mark.parametrize("route", ["/tokenize", "/v1/score", "/v2/rerank"])
def test_wrong_method_and_no_key(gw: tuple[str, dict[str, str]], route: str) -> None:
    base, keys = gw
    got = httpx.get(f"{base}{route}", headers={"Authorization": f"Bearer {keys['default']}"})
    assert got.status_code == 405 and got.headers["allow"] == "POST"
    assert got.json()["error"]["code"] == 405
    anonymous = httpx.post(f"{base}{route}", json={"model": "open"})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
