"""Made-up log probabilities in vLLM's chat and completions shapes."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.sim.errors import SimError
from loadtest.sim.logprobs import chat_logprobs, completion_logprobs, joined, prompt_logprobs
from loadtest.sim.parse import parse_generation

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def test_chat_entries_have_token_logprob_bytes_and_sorted_alternatives() -> None:
    out = chat_logprobs(" the and", 7, 0, 3)
    assert [e["token"] for e in out["content"]] == [" the", " and"]
    for entry in out["content"]:
        assert -4 < entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"]
        assert len({t["token"] for t in top}) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)


def test_a_stream_gets_the_same_values_as_the_whole_answer() -> None:
    whole = completion_logprobs(" the and for", 7, 0, 2)
    parts = [completion_logprobs(t, 7, off, 2) for t, off in ((" the", 0), (" and for", 4))]
    for key in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
        assert whole[key] == parts[0][key] + parts[1][key]
    assert whole["text_offset"] == [0, 4, 8]


def test_completions_logprobs_0_is_the_sampled_token_only() -> None:
    out = completion_logprobs(" the", 1, 0, 0)
    assert out["top_logprobs"] == [{" the": out["token_logprobs"][0]}]


@pytest.mark.parametrize(("body", "chat", "expected"), [
    (CHAT, True, None),
    ({**CHAT, "logprobs": True}, True, 0),
    ({**CHAT, "logprobs": True, "top_logprobs": 5}, True, 5),
    ({**CHAT, "logprobs": False, "top_logprobs": 0}, True, None),
    ({"model": "m", "prompt": "x"}, False, None),
    ({"model": "m", "prompt": "x", "logprobs": 3}, False, 3),
])
def test_what_is_asked_for(body: dict[str, Any], chat: bool, expected: int | None) -> None:
    assert parse_generation(body, chat, 4096).logprobs == expected


@pytest.mark.parametrize(("body", "chat", "param"), [
    ({**CHAT, "top_logprobs": 2}, True, "top_logprobs"),  # without logprobs: true
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
    ({**CHAT, "logprobs": "yes"}, True, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": -1}, False, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, False, "logprobs"),
])
def test_bad_logprobs_are_a_400_naming_the_field(body: dict[str, Any], chat: bool,
                                                 param: str) -> None:
    with pytest.raises(SimError) as err:
        parse_generation(body, chat, 4096)
    assert (err.value.status, err.value.param) == (400, param)


def test_an_echoed_prompts_first_token_has_no_logprob() -> None:
    out = prompt_logprobs("hello world", 2)
    assert out["tokens"] == ["hell", "o wo", "rld"] and out["text_offset"] == [0, 4, 8]
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None
    assert all(lp is not None and lp <= 0 for lp in out["token_logprobs"][1:])
    both = joined(out, completion_logprobs(" the", 1, 0, 2, shift=11))
    assert both["tokens"][-1] == " the" and both["text_offset"][-1] == 11


def test_echo_is_completions_only_and_needs_a_text_prompt() -> None:
    assert parse_generation({"model": "m", "prompt": "x", "echo": True}, False, 4096).echo
    assert not parse_generation({**CHAT, "echo": True}, True, 4096).echo
    with pytest.raises(SimError) as err:
        parse_generation({"model": "m", "prompt": [1, 2], "echo": True}, False, 4096)
    assert (err.value.status, err.value.param) == (400, "echo")
