"""200 answers that are not what their head says: JSON compressed (`Content-Encoding: gzip`)
although kvgate asks for identity (a proxy in front of the replica that compresses anyway), and
a body labelled `application/json` that is no JSON object (a proxy's HTML page, an empty or cut
body), or a JSON error object answered with a 200 (a proxy's error in its own shape: the
client got a completion of nothing, ``choices=None``, and no word of the error). kvgate relayed
them as a 200, so the official client failed to decode JSON (and the usage went uncounted),
and the replica was judged by a success. Now each is a failure of that
replica: retried on another one before anything reached the client, else a 502 in OpenAI's
shape.

A real gateway, the official openai client, a loopback replica that answers so, a simulated
one that does not.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Callable

import openai
import orjson
import pytest

from tests.support.bad_replica import CHAT_ANSWER as ANSWER
from tests.support.bad_replica import BadReplica
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

MODEL = "m"


def _json_200(body: bytes, encoding: bytes = b"") -> bytes:
    head = b"content-encoding: %s\r\n" % encoding if encoding else b""
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + head
            + b"content-length: %d\r\n\r\n" % len(body) + body)


MISLABELLED = {
    "gzip": _json_200(gzip.compress(ANSWER), b"gzip"),
    "html": _json_200(b"<html><body>502 Bad Gateway</body></html>"),
    "empty": _json_200(b""),
    "cut": _json_200(ANSWER[:40]),
    "null": _json_200(b"null"),
    "error": _json_200(orjson.dumps({"error": {"message": "no healthy upstream",
                                               "type": "ServiceUnavailable", "code": 503}})),
    "flat-error": _json_200(b' {"object": "error", "message": "no healthy upstream"}'),
}


def _ask(base: str) -> str | None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=15)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return answer.choices[0].message.content


@pytest.mark.parametrize("answer", MISLABELLED.values(), ids=MISLABELLED.keys())
def test_a_lone_replicas_mislabelled_answer_is_a_502(answer: bytes) -> None:
    with BadReplica(MODEL, answer=answer) as bad:
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            with pytest.raises(openai.APIStatusError) as err:
                _ask(base)
            assert err.value.status_code == 502
            assert bad.posts == 1


@pytest.mark.parametrize("answer", MISLABELLED.values(), ids=MISLABELLED.keys())
def test_a_mislabelled_answer_is_retried_on_another_replica(
    sim_factory: Callable[..., tuple[Proc, str]], answer: bytes,
) -> None:
    _, sim = sim_factory(model=MODEL)
    with BadReplica(MODEL, answer=answer) as bad:
        gw, base = gateway_proc(upstreams=[bad.url, sim], args=["--policy", "round_robin"])
        with gw:
            for _ in range(4):
                assert _ask(base)
            assert bad.posts >= 1  # the replica was tried, and passed over


def test_an_error_object_answered_with_a_200_is_a_502_with_its_message() -> None:
    with BadReplica(MODEL, answer=MISLABELLED["error"]) as bad:
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            async def ask() -> None:
                client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                            timeout=15)
                with pytest.raises(openai.APIStatusError) as err:
                    await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}])
                await client.close()
                assert err.value.status_code == 502
                assert err.value.body == {
                    "message": "The replica answered an error with a 200: no healthy upstream",
                    "type": "BadGatewayError", "param": None, "code": 502}

            asyncio.run(ask())


def test_an_answer_with_whitespace_around_its_object_is_relayed() -> None:
    with BadReplica(MODEL, answer=_json_200(b"\r\n " + ANSWER + b" \n")) as bad:
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            assert _ask(base) == "hello"


STORED = orjson.dumps({
    "id": "resp_1", "object": "response", "created_at": 1, "model": MODEL,
    "status": "completed", "output": [],
    "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}})
NOT_AN_OBJECT = {
    **{k: MISLABELLED[k] for k in ("gzip", "html", "cut", "error")},
    "page": b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 6\r\n\r\n<html>",
    "redirect": b"HTTP/1.1 302 Found\r\nlocation: https://10.0.0.1/\r\ncontent-length: 0\r\n\r\n",
    "no-content": b"HTTP/1.1 204 No Content\r\n\r\n",
}


@pytest.mark.parametrize("answer", NOT_AN_OBJECT.values(), ids=NOT_AN_OBJECT.keys())
def test_a_stored_response_answered_with_no_object_is_a_502(answer: bytes) -> None:
    """`GET /v1/responses/{id}` goes to the one replica holding the response: the answer is
    judged as a proxied one (a 2xx other than 200, a redirect, a 200 that is no JSON object)."""
    with BadReplica(MODEL, answer=_json_200(STORED)) as bad:
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            created = client.responses.create(model=MODEL, input="hi")
            bad.get_answer = answer
            with pytest.raises(openai.APIStatusError) as err:
                client.responses.retrieve(created.id)
            assert err.value.status_code == 502
            bad.get_answer = _json_200(STORED)
            assert client.responses.retrieve(created.id).id == created.id


def test_media_types_in_another_case_are_the_same_media_types() -> None:
    """Media types are case-insensitive (RFC 9110 8.3.1): a replica, or a proxy in front of
    it, may send `Application/JSON` or `Text/Event-Stream`. kvgate compared them as written,
    so every answer of such a replica was a 502 "not JSON" / "not the stream asked for", and
    the replica charged a failure for each (a pool behind such a proxy went down whole)."""
    event = b"data: " + orjson.dumps({
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}]})
    stream = b"%s\n\ndata: [DONE]\n\n" % event
    with BadReplica(MODEL) as bad:
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            bad.answer = (b"HTTP/1.1 200 OK\r\ncontent-type: Application/JSON; charset=UTF-8\r\n"
                          b"content-length: %d\r\n\r\n" % len(ANSWER) + ANSWER)
            assert _ask(base) == "hello"
            bad.answer = (b"HTTP/1.1 200 OK\r\ncontent-type: Text/Event-Stream\r\n"
                          b"content-length: %d\r\n\r\n" % len(stream) + stream)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
            assert [c.choices[0].delta.content for c in chunks] == ["hello"]
