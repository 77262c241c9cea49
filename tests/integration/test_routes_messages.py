"""Anthropic's Messages API through kvgate: ``/v1/messages`` (whole and streamed, its SSE
events passed through) and ``/v1/messages/count_tokens``, with the key in ``x-api-key`` as
the Anthropic SDK sends it, the tenant's salt set (a client's never passed), kvgate's own
errors in Anthropic's shape, and the in-flight count back to 0. A real gateway
(authentication on, two tenants) before one simulated replica, over 127.0.0.1 with httpx
(the Anthropic SDK is not among the project's test dependencies)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadtest.sim.extra_routes import CUT_MID_STREAM
from tests.support.gateway import admin_client, inflight, two_tier_gateway, wait_for

ADMIN = "routes-messages-admin-0123456789"
BODY: dict[str, Any] = {
    "model": "open", "max_tokens": 5, "system": "You are terse.",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
}


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _post(base: str, key: str, body: Any, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=30,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"})


def _sent(sim: str, n: int = 1) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = httpx.get(f"{sim}/sim/requests", params={"n": n}).json()[
        "requests"]
    return got


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event, as the Anthropic SDK reads them."""
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line
                     and not line.startswith(":"))
        if "data" in lines:
            out.append((lines.get("event", ""), orjson.loads(lines["data"])))
    return out


def test_a_message_is_answered_with_the_tenants_salt(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    httpx.delete(f"{keys['sim']}/sim/requests")
    answer = _post(base, keys["default"], BODY)
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert (doc["type"], doc["role"], doc["content"][0]["type"]) == ("message", "assistant",
                                                                     "text")
    assert doc["usage"]["output_tokens"] == 5
    assert answer.headers["x-kvgate-replica"]
    sent = _sent(keys["sim"])[0]
    assert sent["path"] == "/v1/messages"
    assert sent["body"]["model"] == "sim-model"
    assert sent["body"]["cache_salt"]
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_a_streamed_message_passes_anthropics_events_unchanged(
    gw: tuple[str, dict[str, str]],
) -> None:
    base, keys = gw
    with httpx.stream("POST", f"{base}/v1/messages", json={**BODY, "stream": True},
                      headers={"x-api-key": keys["default"]}, timeout=30) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = answer.read().decode()
    events = _events(text)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop", text
    assert all(name == data["type"] for name, data in events)
    deltas = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert deltas == "w0 w1 w2 w3 w4"
    assert "[DONE]" not in text and '"error"' not in text
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_two_tenants_same_prompt_get_different_salts(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    httpx.delete(f"{keys['sim']}/sim/requests")
    for key in (keys["default"], keys["premium"]):
        assert _post(base, key, BODY).status_code == 200
    salts = [r["body"]["cache_salt"] for r in _sent(keys["sim"], 2)]
    assert len(set(salts)) == 2 and all(salts)


def test_a_clients_cache_salt_is_never_forwarded(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    httpx.delete(f"{keys['sim']}/sim/requests")
    answer = _post(base, keys["default"], {**BODY, "cache_salt": "someone-elses"})
    assert answer.status_code == 200, answer.text
    assert _sent(keys["sim"])[0]["body"]["cache_salt"] != "someone-elses"


def test_count_tokens_is_routed_without_a_salt(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    httpx.delete(f"{keys['sim']}/sim/requests")
    answer = _post(base, keys["default"], {k: v for k, v in BODY.items() if k != "max_tokens"},
                   "/v1/messages/count_tokens")
    assert answer.status_code == 200, answer.text
    assert answer.json()["input_tokens"] > 0
    sent = _sent(keys["sim"])[0]
    assert sent["path"] == "/v1/messages/count_tokens" and "cache_salt" not in sent["body"]


@pytest.mark.parametrize(("key", "body", "status", "kind"), [
    ("bad", BODY, 401, "authentication_error"),
    ("default", {**BODY, "model": "no-such-model"}, 404, "not_found_error"),
    ("default", {**BODY, "model": "gold-only"}, 404, "not_found_error"),  # another tier's
    ("default", b"{not json", 400, "invalid_request_error"),
])
def test_kvgates_own_errors_are_anthropic_shaped(
    gw: tuple[str, dict[str, str]], key: str, body: Any, status: int, kind: str,
) -> None:
    base, keys = gw
    headers = {"x-api-key": keys.get(key, "sk-not-a-key"), "content-type": "application/json"}
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    answer = httpx.post(f"{base}/v1/messages", content=raw, headers=headers, timeout=30)
    assert answer.status_code == status
    doc = answer.json()
    assert doc["type"] == "error" and doc["error"]["type"] == kind, doc
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    assert keys["default"] not in answer.text
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_the_replicas_anthropic_error_passes_through(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    answer = _post(base, keys["default"], {**BODY, "messages": []})
    assert answer.status_code == 400
    assert answer.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages: Field required"}}


def test_a_get_is_an_anthropic_shaped_405(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    answer = httpx.get(f"{base}/v1/messages", headers={"x-api-key": keys["default"]})
    assert answer.status_code == 405
    assert answer.headers["allow"] == "POST"
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_a_replica_failing_mid_stream_ends_with_anthropics_error_event(
    gw: tuple[str, dict[str, str]],
) -> None:
    base, keys = gw
    body = {**BODY, "stream": True, "metadata": {"user_id": CUT_MID_STREAM}}
    with httpx.stream("POST", f"{base}/v1/messages", json=body,
                      headers={"x-api-key": keys["default"]}, timeout=30) as answer:
        assert answer.status_code == 200
        text = answer.read().decode()
    events = _events(text)
    assert [name for name, _ in events][:2] == ["message_start", "content_block_start"]
    name, data = events[-1]
    assert name == "error" and data["type"] == "error", text
    assert data["error"]["type"] == "api_error" and data["error"]["message"]
    assert "[DONE]" not in text and "message_stop" not in text
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_a_large_message_is_prepared_off_the_loop_alike(gw: tuple[str, dict[str, str]]) -> None:
    """A body past `OFF_LOOP_BYTES` is parsed, and its prefix computed, in a worker thread
    (`Preparer._digest`): the same salt and answer."""
    base, keys = gw
    httpx.delete(f"{keys['sim']}/sim/requests")
    big = {**BODY, "system": "Long instructions. " * 12_000}  # ~220 KB
    answer = _post(base, keys["default"], big)
    assert answer.status_code == 200, answer.text
    small = _post(base, keys["default"], BODY)
    assert small.status_code == 200
    salts = [r["body"]["cache_salt"] for r in _sent(keys["sim"], 2)]
    assert salts[0] == salts[1] and salts[0]


def test_a_tenant_over_its_limit_gets_anthropics_rate_limit_error(
    gw: tuple[str, dict[str, str]],
) -> None:
    base, _ = gw
    with admin_client(base, ADMIN) as admin:
        made = admin.post("/tenants", json={"id": "capped", "tier": "default",
                                            "limits": {"rpm": 1}})
        assert made.status_code == 201, made.text
        key = admin.post("/tenants/capped/keys").json()["key"]
    assert _post(base, key, BODY).status_code == 200
    refused = _post(base, key, BODY)
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
