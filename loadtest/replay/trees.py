"""Two more shapes routing was not tuned on: long shared documents and prefixes shared at depths.

Seeded and deterministic like `loadtest.replay.shapes` (`loadtest.replay.generators` registers
them):

- `long_context`: a few long documents (16k-64k tokens) each read by many users over the run
  (the document and a short question), occasional long prompts nobody else sends, and a
  background of short chat. At 262,144 KV tokens per replica one document is 1/16 to 1/4 of a
  replica's cache: a second copy of a document costs a second or more of prefill, one copy
  concentrates its readers on one replica.
- `prefix_tree`: few-shot / template traffic: a tenant's long system prompt, one of the
  tenant's task templates, one of the template's few-shot example sets, the user's input; Zipf
  popularity at every level. Requests share prefixes at three depths, so a placement that keeps
  subtrees together beats one that spreads or pins whole prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.replay.draws import blocks, request, tokens, zipf
from loadtest.replay.workload import IdSource, ReplayRequest

__all__ = [
    "LongContextSpec", "PrefixTreeSpec", "long_context", "long_context_drawn", "prefix_tree",
    "prefix_tree_drawn",
]


@dataclass(frozen=True, slots=True)
class LongContextSpec:
    requests: int = 3000
    rate_per_s: float = 20.0  # busy; at 36/s past capacity (262,144: preemptions, p99 13.6 s)
    documents: int = 24
    document_tokens: tuple[int, int] = (16_384, 65_536)
    zipf: float = 1.0
    document_probability: float = 0.55  # a question on a document
    unique_probability: float = 0.03  # a long prompt nobody else sends
    unique_tokens: tuple[int, int] = (16_384, 65_536)
    system_prompts: int = 2  # the chat's (the rest: short chat on one of them)
    system_tokens: tuple[int, int] = (256, 1024)
    chat_tokens: tuple[int, int] = (64, 2048)
    question_tokens: tuple[int, int] = (16, 256)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 25


def long_context(spec: LongContextSpec | None = None) -> list[ReplayRequest]:
    """A question on a Zipf-popular long document, a unique long prompt, or short chat."""
    return long_context_drawn(spec)[0]


def long_context_drawn(
    spec: LongContextSpec | None = None,
) -> tuple[list[ReplayRequest], list[int | None], list[list[int]]]:
    """`long_context`'s requests, each one's document (an index; None: not a question on a
    document) and the documents' blocks."""
    s = spec or LongContextSpec()
    rng, ids = random.Random(s.seed), IdSource()
    docs = [ids.take(blocks(tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    doc = zipf(rng, s.documents, s.zipf)
    out, chosen, t = [], [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        kind, d = rng.random(), None
        if kind < s.document_probability:
            d = doc()
            prompt = docs[d] + ids.take(blocks(tokens(rng, *s.question_tokens)))
        elif kind < s.document_probability + s.unique_probability:
            prompt = ids.take(blocks(tokens(rng, *s.unique_tokens)))
        else:
            prompt = systems[rng.randrange(s.system_prompts)] + ids.take(
                blocks(tokens(rng, *s.chat_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens)))
        chosen.append(d)
    return out, chosen, docs


@dataclass(frozen=True, slots=True)
class PrefixTreeSpec:
    requests: int = 6000
    rate_per_s: float = 60.0  # busy; at 80/s e2e p99 ~10 s (262,144, cache_aware)
    tenants: int = 6
    system_tokens: tuple[int, int] = (2048, 8192)
    templates: int = 6  # per tenant
    template_tokens: tuple[int, int] = (512, 2048)
    example_sets: int = 10  # per template
    example_tokens: tuple[int, int] = (1024, 6144)
    zipf: float = 1.0  # at every level
    input_tokens: tuple[int, int] = (32, 1024)
    output_tokens: tuple[int, int] = (16, 256)
    seed: int = 26


Path = tuple[int, int, int]  # (tenant, template, example set)


def prefix_tree(spec: PrefixTreeSpec | None = None) -> list[ReplayRequest]:
    """Each request: tenant, template and example set drawn Zipf, then a new input."""
    return prefix_tree_drawn(spec)[0]


def prefix_tree_drawn(spec: PrefixTreeSpec | None = None) -> tuple[list[ReplayRequest], list[Path]]:
    """`prefix_tree`'s requests and each one's path down the tree."""
    s = spec or PrefixTreeSpec()
    rng, ids = random.Random(s.seed), IdSource()

    def text(size: tuple[int, int]) -> list[int]:
        return ids.take(blocks(tokens(rng, *size)))

    systems = [text(s.system_tokens) for _ in range(s.tenants)]
    templates = [[text(s.template_tokens) for _ in range(s.templates)] for _ in range(s.tenants)]
    examples = [[[text(s.example_tokens) for _ in range(s.example_sets)]
                 for _ in range(s.templates)] for _ in range(s.tenants)]
    tenant = zipf(rng, s.tenants, s.zipf)
    template = zipf(rng, s.templates, s.zipf)
    example = zipf(rng, s.example_sets, s.zipf)
    out, paths, t = [], [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        a, b, c = tenant(), template(), example()
        prompt = systems[a] + templates[a][b] + examples[a][b][c] + text(s.input_tokens)
        out.append(request(t, prompt, tokens(rng, *s.output_tokens)))
        paths.append((a, b, c))
    return out, paths
