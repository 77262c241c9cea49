"""vLLM's client routes behind a real Envoy, the picker choosing: Anthropic's `/v1/messages`
with the official Anthropic SDK (whole, streamed, count_tokens, a bad key, an unknown model:
its typed errors) and the picker's own refusals there in Anthropic's shape (400, 405, 413,
429 with Retry-After, 503), as the HTTP edge answers them; a stream the picker ends itself
(the replica's ends before `message_stop`) ends with Anthropic's ``event: error``; rerank,
score and tokenize through Envoy with httpx; the tenant's salt at the replica; in-flight back
to 0. Real picker (authentication on), real Envoy, a simulated replica, a scripted one
(`BadReplica`) for the short stream, a pool whose replica listens nowhere for the 503."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import AUTH_SECRET, FAST_HEALTH, admin_client, inflight, wait_for
from tests.support.procs import Proc, free_port, sim_proc

anthropic: Any = pytest.importorskip("anthropic", reason="run scripts/setup (test extra)")

ADMIN = "routes2-epp-admin-token-0123456789"
LIMIT = 100_000  # server.max_body_bytes
TURNS = [{"role": "user", "content": "Summarise the change."}]
BODY: dict[str, Any] = {"model": "open", "max_tokens": 3, "messages": TURNS}
START = b"event: message_start\ndata: " + orjson.dumps({"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "bad-model", "content": [],
    "stop_reason": None, "stop_sequence": None,
    "usage": {"input_tokens": 3, "output_tokens": 0}}}) + b"\n\n"
BLOCK = b"event: content_block_start\ndata: " + orjson.dumps({
    "type": "content_block_start", "index": 0,
    "content_block": {"type": "text", "text": ""}}) + b"\n\n"
DELTA = b"event: content_block_delta\ndata: " + orjson.dumps({
    "type": "content_block_delta", "index": 0,
    "delta": {"type": "text_delta", "text": "half"}}) + b"\n\n"


class Stack:
    """Envoy's base URL, the picker's HTTP base, the simulated replica's URL, the keys."""

    def __init__(self, base: str, picker: str, sim: str, key: str, capped: str) -> None:
        self.base, self.picker, self.sim, self.key, self.capped = base, picker, sim, key, capped


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    with BadReplica("bad-model") as bad:
        bad.answer = sse_head() + chunked(START, BLOCK, DELTA)  # ended whole, before message_stop
        try:
            sim, url = sim_proc(None, "--time-scale", "50", model="sim-model")
            procs.append(sim.start())
            config = {
                "pools": {"p": {"served_model": "sim-model", "replicas": [url]},
                          "b": {"served_model": "bad-model", "replicas": [bad.url]},
                          "d": {"served_model": "gone", "replicas": [
                              f"http://127.0.0.1:{free_port()}"]}},
                "models": {"open": {"default": "p", "capped": "p"},
                           "broken": {"default": "b"}, "down": {"default": "d"}},
                "tiers": {"capped": {"limits": {"rpm": 1}}},
                "health": {**FAST_HEALTH, "failure_threshold": 1000},
                "server": {"max_body_bytes": LIMIT},
                "tenants": [{"id": "basic", "tier": "default"},
                            {"id": "capped", "tier": "capped"}]}
            epp = epp_proc(config=config, env={"KVGATE_SALT_SECRET": AUTH_SECRET,
                                               "KVGATE_ADMIN_TOKEN": ADMIN}, auth=True)
            procs.append(epp.start())
            with admin_client(epp.base, ADMIN) as admin:
                keys = [admin.post(f"/tenants/{t}/keys").json()["key"]
                        for t in ("basic", "capped")]
            envoy, base = envoy_proc(epp.picker)
            procs.append(envoy.start())
            yield Stack(base, epp.base, url, keys[0], keys[1])
        finally:
            for proc in reversed(procs):
                proc.stop()


def _client(stack: Stack, key: str | None = None) -> Any:
    return anthropic.Anthropic(base_url=stack.base, api_key=key or stack.key, max_retries=0)


def _sent(stack: Stack) -> dict[str, Any]:
    got: dict[str, Any] = httpx.get(f"{stack.sim}/sim/requests", params={"n": 1}).json()[
        "requests"][0]
    return got


def _post(stack: Stack, body: Any, path: str = "/v1/messages", key: str | None = None,
          **kw: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(f"{stack.base}{path}", content=content, timeout=30, headers={
        "x-api-key": key or stack.key, "content-type": "application/json"}, **kw)


def _anthropic_error(answer: httpx.Response, status: int, type_: str) -> str:
    assert answer.status_code == status, answer.text
    doc = answer.json()
    assert doc["type"] == "error" and doc["error"]["type"] == type_, doc
    message: str = doc["error"]["message"]
    return message


def test_the_sdk_through_envoy_whole_streamed_and_counted(stack: Stack) -> None:
    client = _client(stack)
    httpx.delete(f"{stack.sim}/sim/requests")
    msg = client.messages.create(model="open", max_tokens=4, system="Be brief.",
                                 messages=TURNS)
    assert msg.content[0].text == "w0 w1 w2 w3" and msg.usage.output_tokens == 4
    sent = _sent(stack)
    assert sent["path"] == "/v1/messages" and sent["body"]["model"] == "sim-model"
    assert sent["body"]["cache_salt"]  # the tenant's, set by the picker as at the HTTP edge
    with client.messages.stream(model="open", max_tokens=3, messages=TURNS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "w0 w1 w2" and final.stop_reason == "max_tokens"
    assert client.messages.count_tokens(model="open", messages=TURNS).input_tokens > 0
    assert "cache_salt" not in _sent(stack)["body"]
    wait_for(lambda: inflight(stack.picker) == 0, what="in-flight back to 0")


def test_the_sdk_raises_its_typed_errors_for_the_pickers_refusals(stack: Stack) -> None:
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        _client(stack, "sk-not-a-key").messages.create(model="open", max_tokens=2,
                                                       messages=TURNS)
    assert bad_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        _client(stack).messages.create(model="no-such-model", max_tokens=2, messages=TURNS)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert "no-such-model" in unknown.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        _client(stack).messages.count_tokens(model="no-such-model", messages=TURNS)


def test_the_pickers_refusals_are_anthropic_shaped(stack: Stack) -> None:
    _anthropic_error(_post(stack, b"{not json"), 400, "invalid_request_error")
    _anthropic_error(_post(stack, b"[1]", path="/v1/messages/count_tokens"), 400,
                     "invalid_request_error")
    big = {**BODY, "system": "x" * (LIMIT + 10)}
    assert "exceeds" in _anthropic_error(_post(stack, big), 413, "request_too_large")
    refused = httpx.get(f"{stack.base}/v1/messages", headers={"x-api-key": stack.key})
    _anthropic_error(refused, 405, "invalid_request_error")
    assert _post(stack, BODY, key=stack.capped).status_code == 200
    limited = _post(stack, BODY, key=stack.capped)
    _anthropic_error(limited, 429, "rate_limit_error")
    assert int(limited.headers["retry-after"]) >= 1

    def down() -> bool:  # once its health checks found the replica listening nowhere
        return _post(stack, {**BODY, "model": "down"}).status_code == 503

    wait_for(down, timeout=30, what="the pool without a replica answered 503")
    unavailable = _post(stack, {**BODY, "model": "down"})
    _anthropic_error(unavailable, 503, "overloaded_error")
    wait_for(lambda: inflight(stack.picker) == 0, what="in-flight back to 0")


def test_a_stream_the_picker_ends_ends_with_anthropics_error_event(stack: Stack) -> None:
    with httpx.stream("POST", f"{stack.base}/v1/messages", timeout=30,
                      json={**BODY, "model": "broken", "stream": True},
                      headers={"x-api-key": stack.key}) as answer:
        assert answer.status_code == 200
        text = answer.read().decode()
    assert "event: message_start" in text and "[DONE]" not in text
    last = text.strip().split("\n\n")[-1].splitlines()
    assert last[0] == "event: error", text
    assert orjson.loads(last[1].removeprefix("data: "))["type"] == "error"
    client = _client(stack)
    with pytest.raises(anthropic.APIStatusError), client.messages.stream(
            model="broken", max_tokens=3, messages=TURNS) as stream:
        for _ in stream.text_stream:  # (raised at the error event)
            pass
    wait_for(lambda: inflight(stack.picker) == 0, what="in-flight back to 0")


def test_rerank_score_and_tokenize_through_envoy(stack: Stack) -> None:
    httpx.delete(f"{stack.sim}/sim/requests")
    rerank = _post(stack, {"model": "open", "query": "q", "documents": ["a b", "q c"]},
                   path="/v1/rerank")
    assert rerank.status_code == 200, rerank.text
    assert len(rerank.json()["results"]) == 2
    assert _sent(stack)["body"]["cache_salt"]  # a pooling request takes the tenant's salt
    score = _post(stack, {"model": "open", "text_1": "q", "text_2": ["a", "q"]},
                  path="/score")
    assert score.status_code == 200 and len(score.json()["data"]) == 2, score.text
    tokens = _post(stack, {"model": "open", "prompt": "hello there"}, path="/tokenize")
    assert tokens.status_code == 200 and tokens.json()["count"] > 0, tokens.text
    assert "cache_salt" not in _sent(stack)["body"]
    wait_for(lambda: inflight(stack.picker) == 0, what="in-flight back to 0")
