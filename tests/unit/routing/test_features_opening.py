"""A chat whose opening (its text through the first user message) ends inside block 0 leads
its chain with the opening's hash: every turn of a short conversation shares a first entry from
the first turn on. Before, a conversation shorter than a block had no chain at all, and its
first turns were placed on load alone (tests/integration/test_short_conversations.py)."""

from __future__ import annotations

from typing import Any

from routing.canon import canonical_text, canonical_text_and_opening
from routing.features import block_hashes, extract_features, root_seed

from .helpers import CFG

BC = CFG.block_chars
SYSTEM = "You are a helpful assistant."
QUESTION = "What is a KV cache, and why does it matter?"


def _features(messages: list[dict[str, Any]], salt: str = "s", **body: Any) -> tuple[int, ...]:
    return extract_features({"messages": messages, **body}, model="m", salt=salt,
                            config=CFG).block_hashes


def _turns(question: str, answers: int) -> list[list[dict[str, Any]]]:
    """The message lists of a conversation's first ``answers + 1`` turns."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": question}]
    out = [list(messages)]
    for t in range(answers):
        messages += [{"role": "assistant", "content": f"answer {t}: " + "words " * 12},
                     {"role": "user", "content": f"and then, point {t}?"}]
        out.append(list(messages))
    return out


def test_every_turn_of_a_short_conversation_shares_the_first_entry() -> None:
    chains = [_features(m) for m in _turns(QUESTION, 5)]
    texts = [canonical_text({"messages": m}) for m in _turns(QUESTION, 5)]
    assert len(texts[0]) < BC < len(texts[-1])  # from shorter than a block to several
    assert len(chains[0]) == 1  # it had no chain
    assert len({c[0] for c in chains}) == 1
    # past the first entry, the blocks are block 0's chain as before
    last = block_hashes(texts[-1], root_seed("m", "s"), BC, CFG.max_blocks)
    assert chains[-1][1:] == last[1:] and chains[-1][0] != last[0]


def test_conversations_with_other_openings_lead_with_other_entries() -> None:
    a = _features(_turns(QUESTION, 1)[1])
    b = _features(_turns("What is paged attention, and why does it matter?", 1)[1])
    assert a[0] != b[0]
    # a tenant's salt seeds the opening too: tenants never share it
    assert _features(_turns(QUESTION, 0)[0], salt="t")[0] != a[0]


def test_an_opening_past_block_0_leaves_the_chain_as_it_was() -> None:
    messages = [{"role": "system", "content": "rules " * 100}, {"role": "user", "content": "hi"}]
    text, opening = canonical_text_and_opening({"messages": messages})
    assert opening > BC
    assert _features(messages) == block_hashes(text, root_seed("m", "s"), BC, CFG.max_blocks)


def test_the_opening_is_through_the_first_user_message() -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    text, opening = canonical_text_and_opening({"messages": messages, "tools": [{"x": 1}]})
    first, _ = canonical_text_and_opening({"messages": messages[:2], "tools": [{"x": 1}]})
    assert text.startswith(first) and opening == len(first)
    # no user message, or not a chat: no opening, no chain for a short prompt
    assert canonical_text_and_opening({"messages": messages[:1]})[1] == 0
    assert canonical_text_and_opening({"prompt": "hi"}) == ("hi", 0)
    assert extract_features({"prompt": "hi"}, model="m", salt="s", config=CFG).block_hashes == ()
    assert _features([{"role": "assistant", "content": "hello"}]) == ()


def test_an_opening_shorter_than_a_vllm_block_leads_nothing() -> None:
    """"hi" (no system prompt) is cached nowhere (vLLM caches 16-token blocks) and would name
    every conversation of the tenant that opens with it: no entry, as before."""
    assert _features([{"role": "user", "content": "hi"}]) == ()
    turn2 = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 300},
             {"role": "user", "content": "go on"}]
    text = canonical_text({"messages": turn2})
    assert _features(turn2) == block_hashes(text, root_seed("m", "s"), BC, CFG.max_blocks)
