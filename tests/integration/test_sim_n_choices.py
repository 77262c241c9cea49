"""`n > 1` end to end: the official openai client through a real `kvgate serve` in front of
real `kvgate sim` replicas gets n whole choices, streamed and not, and the gateway counts the
output tokens of all of them; a replica computes the shared prompt once."""

from __future__ import annotations

from collections import defaultdict

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_gateway_vllm_streams import SimFactory
from tests.support.gateway import gateway_proc, metric_values

MODEL = "sim-model"
LONG = "You are a helpful assistant. " * 40  # ~290 tokens: 4 full 64-token blocks


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)


def completion_tokens(base: str) -> float:
    values = metric_values(base, "kvgate_tokens_total")
    return sum(v for labels, v in values.items() if 'kind="completion"' in labels)


def sim_counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def test_a_streamed_n2_chat_reaches_the_client_whole(sim_factory: SimFactory) -> None:
    _, sim_a = sim_factory("--time-scale", "50")
    _, sim_b = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim_a, sim_b])
    with gw:
        stream = client(base).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "two answers please"}],
            max_tokens=6, n=2, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks = list(stream)
        text: dict[int, str] = defaultdict(str)
        finish: dict[int, str | None] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                text[choice.index] += choice.delta.content or ""
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
        assert sorted(text) == [0, 1] and text[0] != text[1]
        assert all(len(t) == 24 for t in text.values())  # 6 tokens of 4 characters each
        assert finish == {0: "length", 1: "length"}
        assert not chunks[-1].choices and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 12  # summed over the choices
        assert all(c.usage is None for c in chunks[:-1])
        assert completion_tokens(base) == 12


def test_n_choices_without_include_usage_are_still_counted(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        stream = client(base).completions.create(
            model=MODEL, prompt="three completions", max_tokens=4, n=3, stream=True,
            extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1, 2}
        assert all(chunk.usage is None for chunk in chunks)  # kvgate's usage request dropped
        whole = client(base).completions.create(
            model=MODEL, prompt="three completions", max_tokens=4, n=3,
            extra_body={"ignore_eos": True})
        assert [c.index for c in whole.choices] == [0, 1, 2]
        assert len({c.text for c in whole.choices}) == 3
        assert whole.usage is not None and whole.usage.completion_tokens == 12
        assert completion_tokens(base) == 24


def test_the_prompt_is_computed_once_for_n_sequences(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    answer = client(sim).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=5, n=3)
    assert len(answer.choices) == 3 and answer.usage is not None
    assert answer.usage.completion_tokens == 15
    # the 2 later sequences find the first one's 4 full blocks in the prefix cache
    assert sim_counter(sim, "vllm:prefix_cache_hits_total") == 2 * 4 * 64
    assert sim_counter(sim, "vllm:generation_tokens_total") == 15


def test_n_sequences_count_n_against_the_admission_limit(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", "--max-num-queued-reqs", "2")
    api = client(sim)
    with pytest.raises(openai.APIStatusError) as info:  # 3 sequences > 2, on an idle replica
        api.completions.create(model=MODEL, prompt="x", max_tokens=2, n=3)
    assert info.value.status_code == 503 and "currently busy" in info.value.message
    assert len(api.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2).choices) == 2


def test_a_batch_of_prompts_is_one_choice_per_prompt_and_n(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        api = client(base)
        stream = api.completions.create(
            model=MODEL, prompt=["first prompt", "the second prompt"], max_tokens=3, n=2,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        text: dict[int, str] = defaultdict(str)
        for chunk in chunks:
            for choice in chunk.choices:
                text[choice.index] += choice.text
        assert sorted(text) == [0, 1, 2, 3] and all(len(t) == 12 for t in text.values())
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 12
        alone = api.completions.create(model=MODEL, prompt="the second prompt", max_tokens=3,
                                       extra_body={"ignore_eos": True})
        assert text[2] == alone.choices[0].text  # index = prompt_i * n + j
        assert alone.usage is not None and usage.prompt_tokens > alone.usage.prompt_tokens
        assert completion_tokens(base) == 15
