"""A replica's error kvgate has to re-word on Anthropic's routes is in Anthropic's shape.

When a replica answers `/v1/messages` with an error body kvgate does not relay as it came (a
text page of a dying server, an empty 429 or 503, older vLLM's flat error), kvgate writes the
error itself: it was OpenAI's ``{"error": {"message", "type": "InternalServerError", ...}}``
there, so the Anthropic SDK's ``err.body["error"]["type"]`` read an OpenAI class name, not
Anthropic's ``api_error`` / ``rate_limit_error`` / ``overloaded_error``, and its
``err.body["type"]`` was missing. kvgate's other errors on that route were already
Anthropic's shape; a replica's own Anthropic-shaped error still passes through unchanged.

A real gateway, the official anthropic client, a loopback replica sending the answers.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import orjson
import pytest

from tests.support.bad_replica import BadReplica, behind_a_gateway
from tests.support.gateway import inflight, wait_for

MODEL = "m"


def _answer(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status, content_type, len(body), body)


@pytest.fixture(scope="module")
def replica() -> Iterator[tuple[BadReplica, str]]:
    with behind_a_gateway(MODEL) as pair:
        yield pair


@pytest.mark.parametrize(("status", "body", "content_type", "kind"), [
    (500, b"<html>Internal Server Error</html>", b"text/html", "api_error"),
    (429, b"", b"application/json", "rate_limit_error"),
    (503, b"", b"application/json", "overloaded_error"),
    (400, b'{"object":"error","message":"bad max_tokens","type":"BadRequestError",'
          b'"param":null,"code":400}', b"application/json", "invalid_request_error"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_replaced_replica_error_is_anthropic_shaped(
    replica: tuple[BadReplica, str], status: int, body: bytes, content_type: bytes,
    kind: str, stream: bool,
) -> None:
    bad, base = replica
    bad.answer, bad.end = _answer(status, body, content_type), "keep"
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=30)
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(model=MODEL, max_tokens=5, stream=stream,
                               messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == status
    got = err.value.body
    assert isinstance(got, dict)
    assert got["type"] == "error"
    assert got["error"]["type"] == kind
    assert isinstance(got["error"]["message"], str) and got["error"]["message"]
    assert "Internal Server Error" not in got["error"]["message"]  # (never the page)
    wait_for(lambda: inflight(base) == 0, what="no request left in flight")


def test_a_replicas_own_anthropic_error_passes_through(
    replica: tuple[BadReplica, str],
) -> None:
    bad, base = replica
    own = orjson.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: Field required"}})
    bad.answer, bad.end = _answer(400, own), "keep"
    answer = httpx.post(f"{base}/v1/messages", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 400
    assert answer.json() == orjson.loads(own)


def test_the_openai_routes_keep_openais_shape(replica: tuple[BadReplica, str]) -> None:
    bad, base = replica
    bad.answer, bad.end = _answer(500, b"oops", b"text/plain"), "keep"
    answer = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 500
    assert answer.json()["error"]["type"] == "InternalServerError"


def test_anthropics_error_under_a_200_is_no_message(replica: tuple[BadReplica, str]) -> None:
    """A proxy's Anthropic-shaped error answered with a 200 (its own shape, as an OpenAI one
    under a 200 is judged): the SDK made a `Message` of it, every field None but `type`
    "error", and raised nothing."""
    bad, base = replica
    own = b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}'
    bad.answer, bad.end = _answer(200, own), "keep"
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=30)
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 502
    got = err.value.body
    assert isinstance(got, dict) and got["type"] == "error"
    assert got["error"]["message"] == "The replica answered an error with a 200: Overloaded"
