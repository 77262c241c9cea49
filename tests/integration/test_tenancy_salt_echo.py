"""A tenant's `cache_salt` never reaches a client, even in an error that echoes the request.

vLLM answers a request-level validation failure (e.g. `stream_options` without a stream) with
FastAPI's ``str(exc)`` as its message: every error's ``input`` is the whole body, the salt the
gateway put in it included. The replica here answers every POST that way, with the body it
received, so the test sees exactly what the replica got and what the client was shown.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import orjson
import pytest
from aiohttp import web

from gateway.tenancy.salts import SaltDeriver
from tests.support.gateway import AUTH_SECRET
from tests.support.loop_replica import LoopReplica, acme_gateway

ADMIN = "salt-echo-admin-token-0123456789"


class EchoingReplica(LoopReplica):
    """A replica whose every POST is vLLM's 400 for a failed request validator, the received
    body in its message (as a Python repr, as FastAPI renders it); `bodies` are what came."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, object]] = []

    async def _post(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.bodies.append(body)
        error = {"type": "value_error", "loc": ("body",), "input": body,
                 "msg": "Value error, Stream options can only be defined when `stream=True`."}
        message = f"1 validation error:\n  {error}"
        return web.json_response(
            {"error": {"message": message, "type": "Bad Request", "param": None, "code": 400}},
            status=400)


@pytest.fixture(scope="module")
def echoed() -> Iterator[tuple[EchoingReplica, str, str]]:
    """(the replica, the gateway's base URL, a key of tenant `acme`)."""
    with EchoingReplica() as replica, acme_gateway(replica, ADMIN) as (base, key):
        yield replica, base, key


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_echoing_the_body_does_not_show_the_salt(
    echoed: tuple[EchoingReplica, str, str], stream: bool
) -> None:
    replica, base, key = echoed
    salt = SaltDeriver(AUTH_SECRET).derive("tenant:acme", 0)  # a configured tenant: epoch 0
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=stream)
    assert replica.bodies[-1]["cache_salt"] == salt  # the replica had it to echo
    shown = caught.value.response.text
    assert "validation error" in shown and "'cache_salt': '***'" in shown  # the rest is kept
    assert salt not in shown
    assert salt not in str(caught.value.response.headers)
