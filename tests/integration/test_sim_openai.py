"""`kvgate sim` end to end with the official openai client and prometheus_client's parser."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import sim_proc

MODEL = "sim-model"
LONG = "You are a helpful assistant. " * 40  # ~290 tokens: several 64-token blocks


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    proc, url = sim_proc(None, "--time-scale", "20", "--max-model-len", "4096",
                         "--enable-prompt-tokens-details", model=MODEL)
    with proc:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
           **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    return next(v for (n, ls), v in metrics.items() if n == name and dict(ls) == want)


def test_chat_non_streaming_usage_and_prefix_hit(sim: str) -> None:
    client = _client(sim)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": LONG}, {"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None and again.usage is not None
    assert first.usage.completion_tokens == 5
    assert first.choices[0].message.content == again.choices[0].message.content  # deterministic
    assert len(first.choices[0].message.content or "") == 20  # 4 characters per token
    assert first.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert cached > 0 and cached % 64 == 0 and cached < again.usage.prompt_tokens


def test_cache_salt_isolates(sim: str) -> None:
    client = _client(sim)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG + "salted"}]
    for salt, expect_hit in (("tenant-a", False), ("tenant-a", True), ("tenant-b", False)):
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                              extra_body={"cache_salt": salt})
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        assert ((resp.usage.prompt_tokens_details.cached_tokens or 0) > 0) is expect_hit


def test_streaming_chat_with_include_usage(sim: str) -> None:
    stream = _client(sim).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and len(text) == 24
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_natural_stop_and_stop_strings(sim: str) -> None:
    client = _client(sim)
    full = client.completions.create(model=MODEL, prompt="tell me a story", max_tokens=500)
    assert full.choices[0].finish_reason == "stop"
    assert full.usage is not None and 8 <= full.usage.completion_tokens <= 128
    text = full.choices[0].text
    stop = text[8:12]  # the third generated word
    cut = client.completions.create(model=MODEL, prompt="tell me a story", max_tokens=500,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.usage is not None and cut.usage.completion_tokens == text.find(stop) // 4 + 1


async def test_async_client_streaming_completions(sim: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sim}/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=3,
                                             stream=True, extra_body={"ignore_eos": True})
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert len("".join(texts)) == 12
    resp = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert resp.usage is not None and resp.usage.prompt_tokens == 1
    await client.close()


@pytest.mark.parametrize(
    ("kwargs", "exc", "param"),
    [
        ({"model": "nope"}, openai.NotFoundError, "model"),
        ({"extra_body": {"cache_salt": "a/b"}}, openai.BadRequestError, "cache_salt"),
        ({"extra_body": {"cache_salt": ""}}, openai.BadRequestError, "cache_salt"),
        ({"extra_body": {"cache_salt": "x" * 129}}, openai.BadRequestError, "cache_salt"),
        ({"max_tokens": 5000}, openai.BadRequestError, "max_tokens"),
    ],
)
def test_errors_raise_openai_exceptions(sim: str, kwargs: dict[str, object],
                                        exc: type[openai.APIStatusError], param: str) -> None:
    args: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2, **kwargs}
    with pytest.raises(exc) as info:
        _client(sim).chat.completions.create(**args)  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param


def test_not_found_message_matches_vllm(sim: str) -> None:
    r = httpx.post(f"{sim}/v1/chat/completions",
                   json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `nope` does not exist.",
                                  "type": "NotFoundError", "param": "model", "code": 404}}


def test_models_embeddings_tokenize_version_load(sim: str) -> None:
    client = _client(sim)
    model = client.models.list().data[0]
    assert model.id == MODEL and model.model_extra and model.model_extra["max_model_len"] == 4096
    a = client.embeddings.create(model=MODEL, input=["same", "other"]).data
    b = client.embeddings.create(model=MODEL, input="same").data
    assert a[0].embedding == b[0].embedding != a[1].embedding
    assert sum(x * x for x in a[0].embedding) == pytest.approx(1.0)
    short = client.embeddings.create(model=MODEL, input="x", dimensions=8).data[0]
    assert len(short.embedding) == 8
    with pytest.raises(openai.BadRequestError):  # no longer than the model's vector (a 10**9
        client.embeddings.create(model=MODEL, input="x", dimensions=10**9)  # one hung it)
    tok = httpx.post(f"{sim}/tokenize", json={"model": MODEL, "prompt": "abcdefghi"}).json()
    assert tok["count"] == 3 and tok["max_model_len"] == 4096
    assert httpx.get(f"{sim}/version").json() == {"version": "0.34.0"}
    assert "server_load" in httpx.get(f"{sim}/load").json()


def test_x_request_id_and_request_log(sim: str) -> None:
    client = _client(sim)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "id"}], max_tokens=1,
        extra_headers={"X-Request-Id": "abc123"}, extra_body={"cache_salt": "s1"})
    assert resp.id == "chatcmpl-abc123"
    last = httpx.get(f"{sim}/sim/requests", params={"n": 1}).json()["requests"][-1]
    assert last["headers"]["x-request-id"] == "abc123"
    assert last["headers"]["authorization"] == "Bearer unused"
    assert last["body"]["cache_salt"] == "s1" and last["body"]["model"] == MODEL


def test_metrics_names_and_counters(sim: str) -> None:
    _client(sim).completions.create(model=MODEL, prompt="metrics " * 20, max_tokens=3)
    m = _metrics(sim)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"):
        assert _value(m, name) >= 0
    assert _value(m, "vllm:prefix_cache_queries_total") >= _value(
        m, "vllm:prefix_cache_hits_total")
    assert _value(m, "vllm:generation_tokens_total") >= 3
    assert _value(m, "vllm:prompt_tokens_total") > 0
    assert _value(m, "vllm:request_success_total", finished_reason="length") >= 1
    assert _value(m, "vllm:time_to_first_token_seconds_count") >= 1
    assert _value(m, "vllm:e2e_request_latency_seconds_count") >= 1
    assert any(n == "vllm:inter_token_latency_seconds_count" for n, _ in m)
    info = next(dict(ls) for (n, ls) in m if n == "vllm:cache_config_info")
    assert info["block_size"] == "64" and int(info["num_gpu_blocks"]) > 0  # vLLM 0.34's default
    assert info["engine"] == "0"
