"""Whether the official openai client retries what kvgate answers (it retries 408, 409, 429
and 5xx unless the answer says ``x-should-retry: false``). A request that vLLM failed with its
500 for that request (an exception serving it, not a dead engine) on two replicas, kvgate's
own retry included, fails wherever it runs: the SDK's two retries sent it twice more to
replicas that ran its prompt again, four prefills for one deterministic failure."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from aiohttp import web

from tests.support.gateway import gateway_proc
from tests.support.loop_replica import LoopReplica

# vLLM's answer to a request whose serving raised (an engine still alive: no dead-engine text)
_FAILED = {"error": {"message": "list index out of range", "type": "InternalServerError",
                     "param": None, "code": 500}}

_UNSUPPORTED = {"error": {"message": "not supported with this engine",
                          "type": "NotImplementedError", "param": None, "code": 501}}


class FailingReplica(LoopReplica):
    """A replica answering every chat request with vLLM's per-request 500, counting them."""

    def __init__(self) -> None:
        super().__init__()
        self.posts = 0

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.posts += 1
        if body.get("n") == 3:  # vLLM's NotImplementedError (a feature its engine lacks)
            return web.json_response(_UNSUPPORTED, status=501)
        if not body.get("stream"):
            return web.json_response(_FAILED, status=500)
        # a stream: vLLM sends the head at once, then the error event and [DONE]
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(_FAILED).encode() + b"\n\ndata: [DONE]\n\n")
        return resp


@pytest.fixture(scope="module")
def two_failing() -> Iterator[tuple[str, list[FailingReplica]]]:
    with FailingReplica() as a, FailingReplica() as b:
        config = {"pools": {"p": {"served_model": "m", "replicas": [a.url, b.url]}},
                  "models": {"llama": {"default": "p"}},
                  # no ejection while the test sends its few requests
                  "health": {"failure_threshold": 50}}
        gw, base = gateway_proc(config=config)
        with gw.start():
            yield base, [a, b]


def test_a_500_two_replicas_agree_on_is_not_retried_by_the_sdk(
        two_failing: tuple[str, list[FailingReplica]]) -> None:
    base, replicas = two_failing
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=2, timeout=30)
    before = sum(r.posts for r in replicas)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.message.endswith("list index out of range")
    assert caught.value.response.headers.get("x-should-retry") == "false"
    # kvgate's own retry on the other replica, and no more: the SDK sent it once
    assert sum(r.posts for r in replicas) - before == 2


def test_a_stream_two_replicas_failed_alike_is_not_retried_by_the_sdk(
        two_failing: tuple[str, list[FailingReplica]]) -> None:
    base, replicas = two_failing
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=2, timeout=30)
    before = sum(r.posts for r in replicas)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=True)
    assert caught.value.status_code == 502
    assert "list index out of range" in caught.value.message
    assert caught.value.response.headers.get("x-should-retry") == "false"
    assert sum(r.posts for r in replicas) - before == 2


def test_a_501_is_not_retried_by_the_sdk(
        two_failing: tuple[str, list[FailingReplica]]) -> None:
    """vLLM's 501 (a feature its engine lacks) is no failure another try outlasts: relayed,
    the SDK retried it twice as any 5xx."""
    base, replicas = two_failing
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=2, timeout=30)
    before = sum(r.posts for r in replicas)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=3)
    assert caught.value.status_code == 501
    assert caught.value.message.endswith("not supported with this engine")
    assert caught.value.response.headers.get("x-should-retry") == "false"
    assert sum(r.posts for r in replicas) - before == 1
