"""The fields a request's tokens are counted by -- its prompt (`messages`, `prompt`, `input`)
and the output it asks for (`max_tokens`, `max_completion_tokens`, `max_output_tokens`, `n`)
-- are read as vLLM reads them: an output count as pydantic's lax ``int`` (``"300"``,
``300.0``; the gateway read only JSON integers, and reserved its default output for what the
replica ran 300 tokens of), and a value vLLM would not take either is the gateway's 400 naming
it, before the request is admitted or reaches a replica (its tenant's concurrency lease and
the in-flight gauge untouched). A real gateway on Redis in front of a scriptable replica, the
official openai client, sync and async."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, chunked, sse_head, whole
from tests.support.gateway import acme_gateway, admin_client, inflight, request_statuses
from tests.support.procs import redis_proc

ADMIN = "counted-fields-admin-token-01234"
TPM = 1000
CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",' \
    b'"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str, str]]:
    """(replica, gateway base URL, an API key of tenant acme: TPM 1000, one request at
    once)."""
    redis, url = redis_proc()
    with redis, BadReplica("m", whole(CHAT_ANSWER)) as replica:
        proc, base = acme_gateway(replica.url, url, ADMIN, {"tpm": TPM, "max_concurrency": 1})
        with proc, admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
            yield replica, base, key


def _client(gw: tuple[BadReplica, str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw[1]}/v1", api_key=gw[2], max_retries=0, timeout=10)


@pytest.mark.parametrize(("max_tokens", "n", "outputs"), [
    ("300", "2", 2), (300.0, 2.0, 2), (" 300", True, 1), ("3_00", 1, 1)])
def test_output_counts_sent_as_vllm_reads_them_are_reserved(
    gw: tuple[BadReplica, str, str], max_tokens: object, n: object, outputs: int,
) -> None:
    replica = gw[0]
    replica.answer = sse_head() + chunked(CHUNK, DONE)
    try:
        raw = _client(gw).chat.completions.with_raw_response.create(
            model="llama", messages=HELLO, stream=True,
            extra_body={"max_tokens": max_tokens, "n": n})
        chunks = [c for c in raw.parse() if isinstance(c, ChatCompletionChunk)]
        assert [c.choices[0].delta.content for c in chunks] == ["hi"]
    finally:
        replica.answer = whole(CHAT_ANSWER)
    left = int(raw.headers["x-ratelimit-remaining-tokens"])  # the stream's head: reserved
    assert TPM - outputs * 300 - 20 <= left <= TPM - outputs * 300, left


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"max_tokens": "many"}, "max_tokens"),
    ("chat", {"max_tokens": 1.5}, "max_tokens"),
    ("chat", {"max_tokens": -1}, "max_tokens"),
    ("chat", {"max_tokens": [5]}, "max_tokens"),
    ("chat", {"max_completion_tokens": {"n": 5}}, "max_completion_tokens"),
    ("chat", {"n": 2.5}, "n"),
    ("chat", {"n": "two"}, "n"),
    ("chat", {"n": "99999999999999999999999"}, "n"),  # past what orjson writes back
    ("chat", {"messages": "Hello"}, "messages"),
    ("chat", {"messages": {"role": "user", "content": "Hello"}}, "messages"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": {"text": "x"}}, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("responses", {"input": 7}, "input"),
    ("responses", {"input": "x", "max_output_tokens": "lots"}, "max_output_tokens"),
    ("embeddings", {"input": {"text": "x"}}, "input"),
]


def _send(client: openai.OpenAI, kind: str, fields: dict[str, Any]) -> object:
    if kind == "chat":
        body: dict[str, Any] = {"messages": HELLO, **fields}
        return client.chat.completions.create(model="llama", **body)
    if kind == "completions":
        return client.completions.create(model="llama", prompt=fields.pop("prompt"),
                                         extra_body=fields)
    if kind == "responses":
        return client.responses.create(model="llama", input=fields.pop("input"),
                                       extra_body=fields)
    return client.embeddings.create(model="llama", input=fields.pop("input"))


@pytest.mark.parametrize(("kind", "fields", "param"), BAD,
                         ids=[f"{k}-{p}-{i}" for i, (k, _, p) in enumerate(BAD)])
def test_a_counted_field_of_a_wrong_type_is_a_400_naming_it(
    gw: tuple[BadReplica, str, str], kind: str, fields: dict[str, Any], param: str,
) -> None:
    replica, base, _ = gw
    posts, before = replica.posts, request_statuses(base).get("400", 0.0)
    with pytest.raises(openai.BadRequestError) as info:
        _send(_client(gw), kind, dict(fields))
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == param and info.value.body["type"] == "BadRequestError"
    assert f"`{param}`" in info.value.body["message"]
    assert replica.posts == posts  # never sent
    assert request_statuses(base).get("400", 0.0) == before + 1
    assert inflight(base) == 0
    # its tenant's one concurrency slot is free: the next request is served
    answer = _client(gw).chat.completions.create(model="llama", messages=HELLO, max_tokens=5)
    assert answer.choices[0].message.content == "hello"


def test_the_async_client_gets_the_400_and_the_slot_back(gw: tuple[BadReplica, str, str]) -> None:
    async def run() -> list[str | None]:
        client = openai.AsyncOpenAI(base_url=f"{gw[1]}/v1", api_key=gw[2], max_retries=0,
                                    timeout=10)
        params: list[str | None] = []
        for _ in range(5):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(
                    model="llama", messages=HELLO, stream=True,
                    extra_body={"max_tokens": "a few"})
            params.append(info.value.body["param"] if isinstance(info.value.body, dict)
                          else None)
        answer = await client.chat.completions.create(model="llama", messages=HELLO)
        assert answer.choices[0].message.content == "hello"
        await client.close()
        return params

    assert asyncio.run(run()) == ["max_tokens"] * 5
    assert inflight(gw[1]) == 0


def test_fields_the_gateway_does_not_count_pass_untouched(
    gw: tuple[BadReplica, str, str],
) -> None:
    """vLLM judges those (a `temperature` of "hot" is its 400, not the gateway's)."""
    replica = gw[0]
    posts = replica.posts
    answer = _client(gw).chat.completions.create(
        model="llama", messages=HELLO,
        extra_body={"temperature": "hot", "top_p": [1], "seed": "x", "max_tokens": None})
    assert answer.choices[0].message.content == "hello"
    assert replica.posts == posts + 1
