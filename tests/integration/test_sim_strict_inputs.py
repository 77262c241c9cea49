"""Inputs a real vLLM 0.34 refuses with a 400, refused by `kvgate sim` in vLLM's error shape and
passed through the gateway unchanged: a message content that is an object, nested embedding
inputs, token ids beyond the vocabulary, a malformed `response_format`, `prompt_logprobs` in a
stream."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.sim.inputs import VOCAB_SIZE
from tests.support.gateway import gateway_proc
from tests.support.procs import sim_proc

MODEL = "sim-model"
USER = {"role": "user", "content": "hello"}
REFUSED: list[tuple[str, dict[str, Any], str | None, str]] = [
    ("chat/completions", {"messages": [{"role": "user", "content": {"type": "text",
                                                                     "text": "hi"}}]},
     "messages", "'messages[0].content' must be a string or a list of content parts"),
    ("embeddings", {"input": [["one", "two"]]}, "input", "'input' must be a string"),
    ("embeddings", {"input": [[["one"]]]}, "input", "'input' must be a string"),
    ("embeddings", {"input": ["one", [1, 2]]}, "input", "'input' must be a string"),
    ("embeddings", {"input": [[1, VOCAB_SIZE]]}, None, f"Token id {VOCAB_SIZE} is out of "
     "vocabulary"),
    ("completions", {"prompt": [3, VOCAB_SIZE + 1], "max_tokens": 2}, None,
     f"Token id {VOCAB_SIZE + 1} is out of vocabulary"),
    ("chat/completions", {"messages": [USER], "response_format": {"type": "json_schema"}},
     "response_format", "the 'json_schema' field must be provided."),
    ("chat/completions", {"messages": [USER], "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format", "with a string 'name'"),
    ("completions", {"prompt": "hi", "stream": True, "prompt_logprobs": 1},
     "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."),
]


@pytest.fixture(scope="module")
def urls() -> Iterator[tuple[list[str], str]]:
    """(the replicas' URLs, the gateway's) with two replicas behind it."""
    procs = [sim_proc(None, "--time-scale", "50", model=MODEL) for _ in range(2)]
    with procs[0][0], procs[1][0]:
        gw, base = gateway_proc(upstreams=[url for _, url in procs])
        with gw:
            yield [url for _, url in procs], base


def _sent(sims: list[str], path: str) -> int:
    """How many `path` requests the replicas received."""
    return sum(r["path"] == path for sim in sims
               for r in httpx.get(f"{sim}/sim/requests").json()["requests"])


@pytest.mark.parametrize(("path", "body", "param", "text"), REFUSED)
def test_refused_as_vllm_and_relayed_unchanged(
    urls: tuple[list[str], str], path: str, body: dict[str, Any], param: str | None, text: str,
) -> None:
    sims, gateway = urls
    direct = httpx.post(f"{sims[0]}/v1/{path}", json={"model": MODEL, **body}, timeout=30)
    assert direct.status_code == 400
    error = direct.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (400, param) and text in error["message"]
    assert error["type"] == ("BadRequestError" if param is None else "Bad Request")
    before = _sent(sims, f"/v1/{path}")
    via = httpx.post(f"{gateway}/v1/{path}", json={"model": MODEL, **body}, timeout=30)
    assert (via.status_code, via.json()) == (400, direct.json())
    assert _sent(sims, f"/v1/{path}") == before + 1  # the client's fault: not tried elsewhere


@pytest.mark.parametrize(("path", "body"), [
    ("embeddings", {"input": [[1, 2], [VOCAB_SIZE - 1]]}),
    ("embeddings", {"input": ["one", "two"]}),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                     "text": "hi"}]}],
                          "max_tokens": 2, "response_format": {
                              "type": "json_schema",
                              "json_schema": {"name": "o", "schema": {"type": "object"}}}}),
    ("completions", {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1}),
])
def test_what_vllm_takes_still_answers(
    urls: tuple[list[str], str], path: str, body: dict[str, Any],
) -> None:
    sims, gateway = urls
    for base in (*sims, gateway):
        reply = httpx.post(f"{base}/v1/{path}", json={"model": MODEL, **body}, timeout=30)
        assert reply.status_code == 200, reply.text
