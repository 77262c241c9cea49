"""`kvgate sim`'s LoRA flags refuse what vLLM refuses, in one line (not a traceback)."""

from __future__ import annotations

import pytest

from loadtest.sim.cli import build_app, parser
from loadtest.sim.lora import parse_lora_modules


@pytest.mark.parametrize(("flags", "said"), [
    (["--max-loras", "0"], "--max-loras must be at least 1"),
    (["--lora-modules", "no-path"], "write name=path"),
    (["--lora-modules", '{"name": "a"}'], "JSON needs 'name' and 'path'"),
])
def test_bad_lora_flags_are_named(flags: list[str], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        build_app(parser().parse_args(["--model", "m", *flags]))


def test_both_lora_module_forms() -> None:
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == {"a": "/x", "b": "/y"}
