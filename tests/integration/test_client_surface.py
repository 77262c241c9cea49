"""What an unmodified OpenAI client sees through kvgate, next to what the replica (or OpenAI)
would answer: the official openai client against a real gateway with authentication on, one
simulated vLLM replica, two tiers. A model the key cannot use is OpenAI's `model_not_found`,
`/v1/models` lists what the key can use (clients pick `data[0].id`), and embeddings come
base64-encoded when asked (the SDK's default), as vLLM sends them."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.gateway import two_tier_gateway

ADMIN = "client-surface-admin-0123456789"


@pytest.fixture(scope="module")
def keys() -> Iterator[tuple[str, dict[str, str]]]:
    """(gateway base URL, {tier: API key, "sim": the replica's URL}) with the public models
    `open` (every tier) and `a-premium-only` (the premium tier; it sorts first)."""
    with two_tier_gateway("a-premium-only", ADMIN) as made:
        yield made


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def test_an_unknown_model_is_openai_model_not_found(keys: tuple[str, dict[str, str]]) -> None:
    base, made = keys
    c = client(base, made["default"])
    with pytest.raises(openai.NotFoundError) as chat:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError) as retrieved:
        c.models.retrieve("nope")
    for caught in (chat.value, retrieved.value):
        assert (caught.code, caught.param) == ("model_not_found", "model")
        assert caught.message.endswith("The model `nope` does not exist. Models served here: "
                                       "open (GET /v1/models lists them).")


def test_models_lists_what_the_key_can_use(keys: tuple[str, dict[str, str]]) -> None:
    base, made = keys
    basic, gold = client(base, made["default"]), client(base, made["premium"])
    assert [m.id for m in gold.models.list()] == ["a-premium-only", "open"]
    listed = [m.id for m in basic.models.list()]
    assert listed == ["open"]
    # the pattern of many clients: the first listed model works
    reply = basic.chat.completions.create(
        model=listed[0], messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.content
    assert gold.models.retrieve("a-premium-only").id == "a-premium-only"
    with pytest.raises(openai.NotFoundError) as caught:
        basic.models.retrieve("a-premium-only")
    assert caught.value.code == "model_not_found"
    assert "not offered to this key's tier" in caught.value.message


def test_embeddings_in_base64_as_vllm_sends_them(keys: tuple[str, dict[str, str]]) -> None:
    base, made = keys
    body = {"input": ["hello", "world"], "encoding_format": "base64"}
    via = httpx.post(f"{base}/v1/embeddings", json={**body, "model": "open"},
                     headers={"Authorization": f"Bearer {made['default']}"}).json()
    direct = httpx.post(f"{made['sim']}/v1/embeddings",
                        json={**body, "model": "sim-model"}).json()
    encoded = [d["embedding"] for d in via["data"]]
    assert encoded == [d["embedding"] for d in direct["data"]]
    assert all(isinstance(e, str) for e in encoded)  # little-endian float32, base64
    raw = base64.b64decode(encoded[0])
    floats = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    c = client(base, made["default"])
    plain = c.embeddings.create(model="open", input="hello", encoding_format="float")
    assert floats == pytest.approx(plain.data[0].embedding, abs=1e-6)
    default = c.embeddings.create(model="open", input="hello")  # base64 on the wire
    assert default.data[0].embedding == pytest.approx(floats)


def _refusal(c: openai.OpenAI, model: str, kind: str) -> tuple[int, str, object]:
    with pytest.raises(openai.BadRequestError) as caught:
        if kind == "suffix":  # fill-in-the-middle clients fall back to prefix-only on this 400
            c.completions.create(model=model, prompt="def f(", suffix="\n", max_tokens=2)
        else:  # stream_options without a stream (a client that forces stream=False)
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2, stream_options={"include_usage": True})
    err = caught.value
    return err.status_code, err.message, err.param


@pytest.mark.parametrize("kind", ["suffix", "stream_options"])
def test_what_vllm_refuses_is_refused_the_same_through_the_gateway(
    keys: tuple[str, dict[str, str]], kind: str,
) -> None:
    base, made = keys
    direct = _refusal(openai.OpenAI(base_url=f"{made['sim']}/v1", api_key="x", max_retries=0),
                      "sim-model", kind)
    assert _refusal(client(base, made["default"]), "open", kind) == direct
    expected = ("suffix is not currently supported" if kind == "suffix"
                else "Stream options can only be defined when `stream=True`.")
    assert direct[0] == 400 and direct[1].endswith(expected)


def _usages(c: openai.OpenAI, model: str, options: dict[str, bool]) -> list[int | None]:
    """The completion tokens each chunk's usage reports (None: a chunk without usage)."""
    stream = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "count"}], max_tokens=6, stream=True,
        extra_body={"ignore_eos": True, "stream_options": options})
    return [ch.usage.completion_tokens if ch.usage else None for ch in stream]


@pytest.mark.parametrize("options", [
    {"include_usage": True, "continuous_usage_stats": True},
    {"continuous_usage_stats": True},  # no usage at all: vLLM wants include_usage too
    {"include_usage": False, "continuous_usage_stats": True},
])
def test_continuous_usage_stats_as_the_replica_sends_them(
    keys: tuple[str, dict[str, str]], options: dict[str, bool],
) -> None:
    base, made = keys
    direct = _usages(openai.OpenAI(base_url=f"{made['sim']}/v1", api_key="x", max_retries=0),
                     "sim-model", options)
    via = _usages(client(base, made["default"]), "open", options)
    if options.get("include_usage"):  # every chunk, the last (choices: []) with the total
        assert None not in direct and None not in via
        assert direct[-1] == via[-1] == 6
    else:
        assert set(direct) == set(via) == {None}


@pytest.mark.parametrize("path", ["/v2/embed", "/cohere/v2/chat", "/invocations"])
def test_a_vllm_endpoint_kvgate_does_not_serve_is_said_so(
    keys: tuple[str, dict[str, str]], path: str,
) -> None:
    base, made = keys
    resp = httpx.post(f"{base}{path}", json={"model": "open", "prompt": "hi"},
                      headers={"Authorization": f"Bearer {made['default']}"})
    assert resp.status_code == 404
    assert resp.json()["error"] == {
        "message": f"{path} is a vLLM endpoint that kvgate does not serve (it serves "
                   "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses and "
                   "/v1/models).",
        "type": "NotFoundError", "param": None, "code": 404}
    # vLLM's operator endpoints stay unknown paths
    sleep = httpx.post(f"{base}/sleep", headers={"Authorization": f"Bearer {made['default']}"})
    assert sleep.json()["error"]["message"] == "Unknown path /sleep."
