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


@pytest.mark.parametrize("prompt", [["one", "two words"], [[1, 2], [3, 4, 5]]])
def test_a_list_of_prompts_is_one_choice_per_prompt_and_n(prompt: Any) -> None:
    gen = _parse({"model": "m", "prompt": prompt, "n": 2}, chat=False)
    assert gen.n == 4 and [p.prompt for p in gen.choices] == [0, 0, 1, 1]
    assert [gen.prompt_of(i).num_tokens for i in range(4)] == [
        gen.prompts[0].num_tokens] * 2 + [gen.prompts[1].num_tokens] * 2
    alone = _parse({"model": "m", "prompt": prompt[1]}, chat=False)
    assert gen.choices[2].seed == alone.seed  # prompt i's first choice is its n=1 answer


def test_each_prompt_of_a_batch_gets_what_fits_beside_it() -> None:
    gen = parse_generation({"model": "m", "prompt": ["a", "b " * 40]}, False, 64)
    assert [p.max_tokens for p in gen.choices] == [63, 64 - gen.prompts[1].num_tokens]


@pytest.mark.parametrize("prompt", [["one", ""], [[1, 2], []], ["one", 3]])
def test_a_bad_prompt_in_a_batch_is_a_400(prompt: Any) -> None:
    with pytest.raises(SimError) as err:
        _parse({"model": "m", "prompt": prompt}, chat=False)
    assert (err.value.status, err.value.param) == (400, "prompt")
