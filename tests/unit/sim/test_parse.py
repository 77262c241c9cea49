"""Chat/completions bodies into what the engine and the streamer need: `n`, prompts."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.sim.errors import SimError
from loadtest.sim.parse import parse_generation

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def _parse(body: dict[str, Any], chat: bool = True) -> Any:
    return parse_generation(body, chat, 4096)


def test_n_plans_one_sequence_each_and_the_first_is_the_n1_answer() -> None:
    one = _parse(CHAT)
    three = _parse({**CHAT, "n": 3})
    assert (one.n, three.n) == (1, 3)
    first = three.plan(0)
    assert (first.seed, first.eos_after, first.visible_chars) == (
        one.seed, one.eos_after, one.visible_chars)
    assert len({p.seed for p in three.choices}) == 3  # each its own text


def test_every_sequence_gets_max_tokens_and_its_own_natural_end() -> None:
    gen = _parse({**CHAT, "n": 8, "max_tokens": 50})
    assert all(p.eos_after is not None and 8 <= p.eos_after <= 128 for p in gen.choices)
    assert len({p.eos_after for p in gen.choices}) > 1
    ignored = _parse({**CHAT, "n": 2, "ignore_eos": True, "max_tokens": 7})
    assert [p.eos_after for p in ignored.choices] == [None, None]


@pytest.mark.parametrize(("n", "message"), [
    (0, "n must be at least 1, got 0."),
    (-2, "n must be at least 1, got -2."),
    (True, "1 validation error: 'n' must be an integer"),
    ("2", "1 validation error: 'n' must be an integer"),
    (10_000, "The simulator supports n up to 128, got 10000."),
])
def test_a_bad_n_is_a_400_naming_it(n: Any, message: str) -> None:
    with pytest.raises(SimError) as err:
        _parse({**CHAT, "n": n})
    assert (err.value.status, err.value.param, err.value.message) == (400, "n", message)


@pytest.mark.parametrize("prompt", ["one", ["one"], [[1, 2, 3]], [1, 2, 3]])
def test_one_prompt_in_any_form(prompt: Any) -> None:
    assert _parse({"model": "m", "prompt": prompt}, chat=False).prompt.num_tokens > 0


@pytest.mark.parametrize("prompt", [["one", "two"], [[1, 2], [3, 4]]])
def test_a_list_of_prompts_is_a_400_that_says_batches_are_not_supported(prompt: Any) -> None:
    with pytest.raises(SimError) as err:
        _parse({"model": "m", "prompt": prompt}, chat=False)
    assert err.value.param == "prompt" and "list of several prompts" in err.value.message
