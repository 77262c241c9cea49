from __future__ import annotations

import pytest

from routing.canon import canonical_text
from routing.config import RouterConfig
from routing.features import block_hashes, extract_features, root_seed
from routing.tokens import count_tokens

from .helpers import CFG, chat, feats

BC = CFG.block_chars
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def canonical_json(value: object) -> str:
    import orjson

    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


@pytest.mark.parametrize(
    ("chars", "blocks"),
    [(0, 0), (BC - 1, 0), (BC, 1), (BC + 1, 1), (2 * BC - 1, 1), (2 * BC, 2), (10 * BC + 7, 10)],
)
def test_only_full_blocks_count(chars: int, blocks: int) -> None:
    f = feats("a" * chars)
    assert len(f.block_hashes) == blocks
    assert f.prompt_tokens == count_tokens(chars)


def test_max_blocks_caps_the_chain() -> None:
    cfg = RouterConfig(max_blocks=3)
    f = feats("x" * BC * 10, config=cfg)
    assert len(f.block_hashes) == 3
    assert f.block_hashes == feats("x" * BC * 10).block_hashes[:3]


def test_salt_changes_every_block() -> None:
    text = "shared system prompt " * 200
    a, b = feats(text, salt="tenant-a"), feats(text, salt="tenant-b")
    assert len(a.block_hashes) == len(b.block_hashes) > 3
    assert not set(a.block_hashes) & set(b.block_hashes)


def test_model_seeds_the_chain() -> None:
    assert root_seed("m1", "s") != root_seed("m2", "s")


def test_chain_names_the_whole_prefix() -> None:
    # the same block text after a different first block hashes differently
    one = block_hashes("A" * BC + "Z" * BC, 1, BC, 10)
    two = block_hashes("B" * BC + "Z" * BC, 1, BC, 10)
    assert one[1] != two[1]


def test_shared_prefix_shares_hashes() -> None:
    base = "doc " * 500
    a, b = feats(base + "question one"), feats(base + "another question entirely")
    common = len(base) // BC
    assert a.block_hashes[:common] == b.block_hashes[:common]


def test_blocks_are_characters_not_bytes() -> None:
    f = feats("é" * BC * 2)  # 2 bytes per char in UTF-8
    assert len(f.block_hashes) == 2
    assert f.prompt_chars == 2 * BC


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (  # key order of the body, of messages and of content parts
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            {"stream": True, "messages": [{"content": "hi", "role": "user"}], "model": "m"},
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
            {"messages": [{"content": [{"text": "hi", "type": "text"}], "role": "user"}]},
        ),
        (  # tools: nested key order
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": 1}}}],
                "messages": [{"role": "user", "content": "x"}],
            },
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"function": {"parameters": {"a": 1}, "name": "f"}, "type": "function"}],
            },
        ),
        (  # sampling parameters do not change the prompt
            {"prompt": "p", "temperature": 0.1, "max_tokens": 3},
            {"prompt": "p", "temperature": 0.9},
        ),
        (  # vLLM joins text parts with a newline: one prompt, one KV cache, one route
            {"messages": [{"role": "user", "content": "rules\nquestion"}]},
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "rules"},
                            {"type": "text", "text": "question"},
                        ],
                    }
                ]
            },
        ),
    ],
)
def test_canonical_text_is_stable(left: dict[str, object], right: dict[str, object]) -> None:
    assert canonical_text(left) == canonical_text(right)


def test_canonical_text_is_stable_across_json_whitespace() -> None:
    import orjson

    compact = b'{"model":"m","messages":[{"role":"user","content":"a  b"}]}'
    spaced = b'{ "model" : "m",\n  "messages" : [ { "content" : "a  b" , "role":"user" } ] }'
    assert canonical_text(orjson.loads(compact)) == canonical_text(orjson.loads(spaced))


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (chat("ab"), chat("a", "b")),  # text moved between messages
        (
            {"messages": [{"role": "user", "content": "x"}]},
            {"messages": [{"role": "system", "content": "x"}]},
        ),
        ({"prompt": "x"}, {"prompt": "x "}),  # whitespace inside the prompt is the prompt
        (
            {"messages": [{"role": "user", "content": "x"}]},
            {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
        ),
        (  # an image part is not a line of text
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE]}]},
            {"messages": [{"role": "user", "content": "a\n" + canonical_json(IMAGE)}]},
        ),
    ],
)
def test_canonical_text_distinguishes(left: dict[str, object], right: dict[str, object]) -> None:
    assert canonical_text(left) != canonical_text(right)


def test_growing_conversation_keeps_its_prefix() -> None:
    turn1 = chat("q" * 2000, system="s" * 1000)
    assert isinstance(turn1["messages"], list)
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": "a" * 500},
            {"role": "user", "content": "next"},
        ]
    }
    assert canonical_text(turn2).startswith(canonical_text(turn1))
    f1 = extract_features(turn1, model="m", salt="s", config=CFG)
    f2 = extract_features(turn2, model="m", salt="s", config=CFG)
    assert f2.block_hashes[: len(f1.block_hashes)] == f1.block_hashes


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["a", "b"]},
        {"prompt": [1, 2, 3]},
        {"input": "x"},
        {},
        {"messages": []},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": ["not a dict"]},
    ],
)
def test_odd_bodies_do_not_raise(body: dict[str, object]) -> None:
    f = extract_features(body, model="m", salt="s", config=CFG)
    assert f.prompt_tokens == count_tokens(len(canonical_text(body)))


@pytest.mark.parametrize(
    "prompt",
    [
        list(range(1000, 3000)),  # ids of 4 and 5 digits
        [0, 1, 2**24 - 1] * 300,  # the ends of the 24 bits written
        [[7] * 600, [8] * 400],  # a batch of token-id prompts: the sum, plus the separator
    ],
)
def test_a_token_id_prompt_counts_a_token_an_id(prompt: list[object]) -> None:
    # as JSON text (``[1000,1001,...]``) 2,000 ids were estimated at ~2,800 tokens: the cost
    # model's prefill work and the context-fit check read it
    ids = [i for p in prompt for i in (p if isinstance(p, list) else [p])]
    f = extract_features({"prompt": prompt}, model="m", salt="s", config=CFG)
    assert len(ids) <= f.prompt_tokens <= len(ids) + 1


def test_token_id_prompts_sharing_ids_share_blocks() -> None:
    head = list(range(50_000, 50_000 + 3 * CFG.tokens_per_block))
    a = extract_features({"prompt": [*head, 1, 2]}, model="m", salt="s", config=CFG)
    b = extract_features({"prompt": [*head, 3]}, model="m", salt="s", config=CFG)
    assert len(a.block_hashes) == 3
    assert a.block_hashes == b.block_hashes
    other = extract_features({"prompt": [5, *head]}, model="m", salt="s", config=CFG)
    assert not set(other.block_hashes) & set(a.block_hashes)


def test_responses_instructions_lead_the_routing_key() -> None:
    # a Responses API request's `instructions` are its system prompt (vLLM puts them first):
    # requests sharing long instructions share a prefix; they were not keyed at all
    instructions = "you are a careful assistant; " * 40
    a = extract_features({"instructions": instructions, "input": "question one"},
                         model="m", salt="s", config=CFG)
    b = extract_features({"instructions": instructions, "input": "another question"},
                         model="m", salt="s", config=CFG)
    alone = extract_features({"input": "question one"}, model="m", salt="s", config=CFG)
    assert len(a.block_hashes) >= 4 and a.block_hashes[:4] == b.block_hashes[:4]
    assert a.prompt_tokens > alone.prompt_tokens + 200


@pytest.mark.parametrize("prompt", [[1, -2], [2**24], [1, True], [1.5, 2]])
def test_ids_vllm_refuses_are_keyed_as_json(prompt: list[object]) -> None:
    import orjson

    assert canonical_text({"prompt": prompt}) == orjson.dumps(prompt).decode()


def test_features_carry_request_fields() -> None:
    f = extract_features(
        {"prompt": "x", "stream": True},
        model="m",
        salt="s",
        config=CFG,
        tenant="acme",
        tier="premium",
        priority=3,
    )
    assert (f.tenant, f.tier, f.stream, f.priority, f.model) == ("acme", "premium", True, 3, "m")
    assert f.prefix_key != feats("y").prefix_key


@pytest.mark.parametrize(("body", "asked"), [
    ({"max_tokens": 300}, 300), ({"max_completion_tokens": 200, "max_tokens": 300}, 200),
    ({"max_output_tokens": 50}, 50), ({}, 0), ({"max_tokens": True}, 0),
    ({"max_tokens": "9"}, 0), ({"max_tokens": -5}, 0),
])
def test_the_output_it_asks_for(body: dict[str, object], asked: int) -> None:
    f = extract_features({"prompt": "hi", **body}, model="m", salt="s", config=RouterConfig())
    assert f.output_tokens == asked
