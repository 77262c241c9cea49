"""The simulator's prompts: token counts, block hashes over text or ids, salts, seeds."""

from __future__ import annotations

import pytest

from loadtest.sim.prompt import Prompt, token_ids


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.mark.parametrize(
    ("a", "b", "shared_blocks"),
    [
        ("x" * 200, "x" * 200, 3),  # 200 chars = 50 tokens = 3 full 16-token blocks
        ("x" * 64 + "y" * 136, "x" * 64 + "z" * 136, 1),  # differ from the 2nd block on
        ("a" + "x" * 199, "b" + "x" * 199, 0),  # a different first block changes every hash
        ("é" * 128, "é" * 128, 2),  # non-ASCII text: blocks are characters, not bytes
    ],
)
def test_text_block_hashes_share_exactly_the_shared_prefix(
    a: str, b: str, shared_blocks: int
) -> None:
    ha, hb = Prompt(text=a).block_hashes(16), Prompt(text=b).block_hashes(16)
    assert _common(ha, hb) == shared_blocks


def test_only_full_blocks_and_salt_changes_every_block() -> None:
    p = Prompt(text="q" * (64 * 3 + 10))
    assert p.num_tokens == 51 and len(p.block_hashes(16)) == 3
    assert not set(p.block_hashes(16, "tenant-a")) & set(p.block_hashes(16, "tenant-b"))
    assert not set(p.block_hashes(16)) & set(p.block_hashes(16, "tenant-a"))


def test_text_and_ids_agree_on_counts_and_ids_prompts_hash_too() -> None:
    text = "hello world, " * 20
    t, i = Prompt(text=text), Prompt(ids=token_ids(text))
    assert t.num_tokens == i.num_tokens == len(t.ids)
    assert len(t.block_hashes(16)) == len(i.block_hashes(16))
    assert t.seed() == Prompt(text=text).seed() != Prompt(text=text + "!").seed()
    with pytest.raises(ValueError):
        Prompt()
