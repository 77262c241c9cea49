"""A vLLM replica served under several names (`--served-model-name a b`) lists each in
`/v1/models` and accepts each. kvgate in front of it: the quick form learns the first name, a
pool configured with another of them is served and learns the context length from that name's
card. Real gateway, a simulated replica, the openai client."""

from __future__ import annotations

from collections.abc import Callable

import openai

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
CONTEXT = 8192


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def test_a_replica_with_several_served_names(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", "--max-model-len", str(CONTEXT),
                         "--served-model-name", "llama", "llama-8b", model="org/Llama-3.1-8B")
    quick, base = gateway_proc(upstreams=[sim])
    with quick:
        assert [m.id for m in _client(base).models.list().data] == ["llama"]
        reply = _client(base).completions.create(model="llama", prompt="x", max_tokens=2)
        assert reply.choices[0].text
    gw, base = gateway_proc(config={"pools": {"p": {"served_model": "llama-8b",
                                                    "replicas": [sim]}}})
    with gw:
        card = _client(base).models.retrieve("llama-8b")
        assert getattr(card, "max_model_len", None) == CONTEXT
        reply = _client(base).completions.create(model="llama-8b", prompt="x", max_tokens=2)
        assert reply.choices[0].text
