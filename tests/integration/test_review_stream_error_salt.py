"""A replica's error event mid-stream that echoes the request no longer shows the tenant's
`cache_salt` to the client.

The whole error answers were masked (`gateway.upstream_errors.without_salt`), but an error
event after a stream had begun was relayed as the replica sent it: a replica echoing the body
it received (as vLLM's validation errors do, a Python repr of it) showed the client the salt
the gateway derives for its tenant, in the SDK's APIError."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import orjson
import pytest
from aiohttp import web

from gateway.tenancy.salts import SaltDeriver
from tests.support.gateway import AUTH_SECRET
from tests.support.loop_replica import LoopReplica, acme_gateway

ADMIN = "stream-salt-admin-token-0123456789"


class StreamingEchoReplica(LoopReplica):
    """A replica whose every stream sends one token, then an error event whose message is
    the body it received (a Python repr), then ``[DONE]``."""

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"},
                              "finish_reason": None}]}
        error = {"error": {"message": f"engine failed for request {body}",
                           "type": "BadRequestError", "code": 400}}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n")
        return resp


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, str]]:
    """(the gateway's base URL, a key of tenant `acme`)."""
    with StreamingEchoReplica() as replica, acme_gateway(replica, ADMIN) as (base, key):
        yield base, key


def test_an_error_event_echoing_the_body_does_not_show_the_salt(
        gateway: tuple[str, str]) -> None:
    base, key = gateway
    salt = SaltDeriver(AUTH_SECRET).derive("tenant:acme", 0)  # a configured tenant: epoch 0
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    tokens = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                stream=True):
            tokens.append(chunk.choices[0].delta.content)
    assert tokens == ["a"]  # the stream before the error is relayed
    shown = f"{caught.value.message} {caught.value.body}"
    assert "engine failed for request" in shown and "'cache_salt': '***'" in shown
    assert salt not in shown
