"""The long-document and prefix-tree shapes (`loadtest.replay.trees`): seeded, and their shape."""

from __future__ import annotations

from collections import Counter

import pytest

from loadtest.replay.draws import BLOCK
from loadtest.replay.trees import (
    LongContextSpec,
    PrefixTreeSpec,
    long_context,
    long_context_drawn,
    prefix_tree,
    prefix_tree_drawn,
)

REPLICA = 262_144  # one replica's KV tokens at the smaller size


def test_long_documents_are_read_by_many_users_over_the_run() -> None:
    s = LongContextSpec()
    reqs, chosen, docs = long_context_drawn(s)
    assert reqs == long_context(s)
    # each document 16k-64k tokens: 1/16 to 1/4 of a 262,144-token replica
    assert all(REPLICA // 16 <= len(d) * BLOCK <= REPLICA // 4 + BLOCK for d in docs)
    readers: dict[int, list[float]] = {}
    for r, d in zip(reqs, chosen, strict=True):
        if d is None:
            continue
        assert r.block_ids[:len(docs[d])] == tuple(docs[d])  # the document, then a question
        assert 1 <= len(r.block_ids) - len(docs[d]) <= 1 + s.question_tokens[1] // BLOCK
        readers.setdefault(d, []).append(r.arrival_s)
    share = sum(1 for d in chosen if d is not None) / len(reqs)
    assert share == pytest.approx(s.document_probability, abs=0.03)
    top = sorted(readers.values(), key=len, reverse=True)
    assert len(top[0]) > 300 and len(top[0]) > 4 * len(top[9])  # Zipf: a few hot documents
    end = reqs[-1].arrival_s
    assert all(min(t) < end / 4 and max(t) > 3 * end / 4 for t in top[:5])  # over the run


def test_long_context_unique_prompts_share_nothing_and_chat_is_short() -> None:
    s = LongContextSpec()
    reqs, chosen, _ = long_context_drawn(s)
    uses = Counter(b for r in reqs for b in r.block_ids)
    others = [r for r, d in zip(reqs, chosen, strict=True) if d is None]
    unique = [r for r in others if uses[r.block_ids[0]] == 1]
    chat = [r for r in others if uses[r.block_ids[0]] > 1]
    assert len(unique) / len(reqs) == pytest.approx(s.unique_probability, abs=0.01)
    assert all(s.unique_tokens[0] <= r.prompt_tokens <= s.unique_tokens[1] + BLOCK
               for r in unique)
    assert all(uses[b] == 1 for r in unique for b in r.block_ids)
    assert all(r.prompt_tokens <= s.system_tokens[1] + s.chat_tokens[1] + 2 * BLOCK
               for r in chat)
    assert len({r.block_ids[0] for r in chat}) == s.system_prompts


def test_prefix_tree_shares_prefixes_at_three_depths_with_zipf_popularity() -> None:
    s = PrefixTreeSpec()
    reqs, paths = prefix_tree_drawn(s)
    assert reqs == prefix_tree(s)
    # the prefix all requests down one path share: a tenant's, a template's, an example set's
    prefix: dict[tuple[int, ...], tuple[int, ...]] = {}
    for r, (a, b, c) in zip(reqs, paths, strict=True):
        keys: tuple[tuple[int, ...], ...] = ((a,), (a, b), (a, b, c))
        for key in keys:
            got = prefix.setdefault(key, r.block_ids)
            pairs = zip(got, r.block_ids, strict=False)  # up to the shorter
            common = next((k for k, (x, y) in enumerate(pairs) if x != y),
                          min(len(got), len(r.block_ids)))
            prefix[key] = got[:common]
    sizes = (s.system_tokens, s.template_tokens, s.example_tokens)
    children = Counter(k[:-1] for k in prefix if len(k) > 1)
    for key, shared in prefix.items():
        low = sum(lo for lo, _ in sizes[:len(key)]) - len(key) * BLOCK
        assert len(shared) * BLOCK >= low  # every level's text, at least
        if len(key) > 1:
            assert len(shared) > len(prefix[key[:-1]])  # a subtree shares more than its parent
        if children[key] > 1:  # siblings part right below their parent's text
            high = sum(hi for _, hi in sizes[:len(key)]) + len(key) * BLOCK
            assert len(shared) * BLOCK <= high
    assert len({v[0] for k, v in prefix.items() if len(k) == 1}) == s.tenants
    # Zipf at each level: the first choice is the most popular, well ahead of the fifth
    for level in range(3):
        counts = Counter(p[level] for p in paths)
        assert counts.most_common(1)[0][0] == 0
        assert counts[0] > 2.5 * counts[4] > 0
    assert len(set(paths)) > 100  # many subtrees, most of them rarely used
