"""Request bodies with numbers and strings JSON allows but no replica can be sent as written,
through the official openai client against a real `kvgate serve --no-auth` in front of a
simulated replica: an integer of hundreds of digits (Python's `json.dumps`, and so the SDK's
`extra_body`, writes one exactly) is the 400 for an integer beyond 64 bits -- it was "number
is infinity when parsed as double", a float the client never sent; a lone UTF-16 surrogate
escape is a 400 naming it, a surrogate pair is one character and is served."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import sim_proc

MODEL = "sim-model"


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    sim, sim_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[sim_url])
        with gw, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                               timeout=60) as sdk:
            yield sdk


def _chat(client: openai.OpenAI, content: str = "hi", **extra: object) -> str:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2,
        extra_body=extra)
    return reply.choices[0].message.content or ""


@pytest.mark.parametrize("seed", [10**400, -(10**400), 10**30], ids=["401-digits", "negative",
                                                                     "31-digits"])
def test_an_integer_of_any_length_beyond_64_bits_is_named_as_such(
    client: openai.OpenAI, seed: int,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, seed=seed)
    message = caught.value.message
    assert "integer beyond 64 bits" in message, message
    assert "infinity" not in message


def test_a_lone_surrogate_is_a_400_and_a_pair_is_served(client: openai.OpenAI) -> None:
    # (the SDK cannot send one: it writes UTF-8, which has no form for it; a client writing
    # ASCII-escaped JSON, as Python's json.dumps does by default, can)
    url = f"{client.base_url}chat/completions"
    for content, status in ((r"\ud800", 400), (r"x\udc00y", 400), (r"\ud83d\ude00", 200)):
        body = (b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, "messages": '
                b'[{"role": "user", "content": "' + content.encode() + b'"}]}')
        answer = httpx.post(url, content=body, headers={"content-type": "application/json"},
                            timeout=60)
        assert answer.status_code == status, (content, answer.text)
        if status == 400:
            error = answer.json()["error"]
            assert error["type"] == "BadRequestError" and "surrogate" in error["message"]
