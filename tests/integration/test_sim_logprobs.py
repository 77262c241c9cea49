"""Log probabilities end to end: the official openai client through a real `kvgate serve` in
front of a real `kvgate sim` parses them, streamed and not, chat and completions."""

from __future__ import annotations

from collections import defaultdict

import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.test_gateway_vllm_streams import SimFactory
from tests.support.gateway import gateway_proc

MODEL = "sim-model"


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)


def test_logprobs_through_the_gateway(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        api = client(base)
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "probabilities"}]
        whole = api.chat.completions.create(model=MODEL, messages=messages,
                                            max_tokens=5, logprobs=True, top_logprobs=3)
        content = whole.choices[0].logprobs.content if whole.choices[0].logprobs else None
        assert content is not None and len(content) == 5
        assert "".join(e.token for e in content) == whole.choices[0].message.content
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
                   for e in content)

        stream = api.chat.completions.create(model=MODEL, messages=messages,
                                             max_tokens=5, logprobs=True, top_logprobs=3, n=2,
                                             stream=True)
        tokens: dict[int, list[str]] = defaultdict(list)
        for chunk in stream:
            for choice in chunk.choices:
                if choice.logprobs and choice.logprobs.content:
                    tokens[choice.index] += [e.token for e in choice.logprobs.content]
        assert tokens[0] == [e.token for e in content]  # choice 0 is the n=1 answer
        assert len(tokens[1]) == 5

        text = api.completions.create(model=MODEL, prompt="probabilities", max_tokens=4,
                                      logprobs=2)
        lp = text.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
        assert "".join(lp.tokens) == text.choices[0].text
        assert lp.text_offset == [0, 4, 8, 12]
        assert all(len(top) == 2 for top in lp.top_logprobs)


def test_echo_through_the_gateway(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        api = client(base)
        whole = api.completions.create(model=MODEL, prompt="echo me", max_tokens=3, echo=True,
                                       logprobs=1)
        text = whole.choices[0].text
        assert text.startswith("echo me") and len(text) == len("echo me") + 12
        lp = whole.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert "".join(lp.tokens) == text and lp.token_logprobs[0] is None
        assert whole.usage is not None and whole.usage.completion_tokens == 3
        stream = api.completions.create(model=MODEL, prompt="echo me", max_tokens=3, echo=True,
                                        stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
