"""Workloads of the shapes production traffic has and the conversation trace lacks.

Each generator returns `ReplayRequest`s (block ids of ``block_tokens`` tokens; equal ids at
equal positions are a shared prefix), seeded, sorted by arrival:

- `hot_prefixes`: a few very hot system prompts and a pool of documents (RAG) with Zipf
  popularity, each request a new question on top: many requests share long prefixes at once.
- `agent_loops`: agent sessions whose one context grows over dozens of calls (tool results
  and the model's own outputs appended), a few agent types sharing a long tool prompt.
- `cold_one_offs`: mostly unique prompts (a few share a short system prompt): nothing to
  gain from the cache, everything from spreading load.
- `bursts`: a mix of the above arriving in bursts (tens of requests at one instant, as batch
  clients and fan-out produce), over a light steady stream.

and the shapes of `loadtest.replay.shapes` and `loadtest.replay.trees`, which routing was not
tuned on: `rag-corpus`, `skewed-tenants`, `load-ramp`, `heavy-tail`, `long-context`,
`prefix-tree`; and of `loadtest.replay.mixes`: `salted-tenants`, `decode-mix`.

`WORKLOADS` names them for `kvgate replay --workload` and the benchmark; `SEEDED` draws them with
another seed (the benchmark averages over several, `DEFAULT_SEEDS` being the first).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from loadtest.replay.draws import BLOCK
from loadtest.replay.draws import blocks as _blocks
from loadtest.replay.draws import request as _request
from loadtest.replay.draws import tokens as _tokens
from loadtest.replay.draws import zipf as _zipf
from loadtest.replay.mixes import DecodeMixSpec, SaltedSpec, decode_mix, salted_tenants
from loadtest.replay.shapes import (
    HeavyTailSpec,
    RagSpec,
    RampSpec,
    SkewSpec,
    heavy_tail,
    load_ramp,
    rag_corpus,
    skewed_tenants,
)
from loadtest.replay.trees import LongContextSpec, PrefixTreeSpec, long_context, prefix_tree
from loadtest.replay.workload import IdSource, ReplayRequest

__all__ = [
    "DEFAULT_SEEDS", "SEEDED", "WORKLOADS", "AgentSpec", "BurstSpec", "ColdSpec",
    "HotPrefixSpec", "agent_loops", "bursts", "cold_one_offs", "hot_prefixes",
]


@dataclass(frozen=True, slots=True)
class HotPrefixSpec:
    requests: int = 4000
    rate_per_s: float = 14.0
    system_prompts: int = 6
    system_tokens: tuple[int, int] = (1024, 6144)
    documents: int = 1500
    document_tokens: tuple[int, int] = (2048, 16384)
    document_probability: float = 0.75
    zipf: float = 0.9
    question_tokens: tuple[int, int] = (64, 768)
    output_tokens: tuple[int, int] = (32, 512)
    seed: int = 11


def hot_prefixes(spec: HotPrefixSpec | None = None) -> list[ReplayRequest]:
    s = spec or HotPrefixSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(_blocks(_tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    docs = [ids.take(_blocks(_tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    system, doc = _zipf(rng, s.system_prompts, s.zipf), _zipf(rng, s.documents, s.zipf)
    out, t = [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        prompt = list(systems[system()])
        if rng.random() < s.document_probability:
            prompt += docs[doc()]
        prompt += ids.take(_blocks(_tokens(rng, *s.question_tokens)))
        out.append(_request(t, prompt, _tokens(rng, *s.output_tokens)))
    return out


@dataclass(frozen=True, slots=True)
class AgentSpec:
    sessions: int = 160
    session_rate_per_s: float = 0.5
    agent_types: int = 4
    tool_prompt_tokens: tuple[int, int] = (3072, 8192)
    task_tokens: tuple[int, int] = (256, 2048)
    calls: tuple[int, int] = (8, 48)
    tool_result_tokens: tuple[int, int] = (128, 3072)
    output_tokens: tuple[int, int] = (48, 384)
    think_s: tuple[float, float] = (1.0, 6.0)  # from one call's arrival to the next
    max_context_tokens: int = 64_000
    seed: int = 12


def agent_loops(spec: AgentSpec | None = None) -> list[ReplayRequest]:
    s = spec or AgentSpec()
    rng, ids = random.Random(s.seed), IdSource()
    tools = [ids.take(_blocks(_tokens(rng, *s.tool_prompt_tokens))) for _ in range(s.agent_types)]
    out, start = [], 0.0
    for _ in range(s.sessions):
        start += rng.expovariate(s.session_rate_per_s)
        context = tools[rng.randrange(s.agent_types)] + ids.take(
            _blocks(_tokens(rng, *s.task_tokens)))
        t = start
        for _call in range(rng.randint(*s.calls)):
            answer = _tokens(rng, *s.output_tokens)
            out.append(_request(t, context, answer))
            # the next call sees this call's answer and the tool's result
            context = context + ids.take(_blocks(answer + _tokens(rng, *s.tool_result_tokens)))
            if len(context) * BLOCK > s.max_context_tokens:
                break
            t += rng.uniform(*s.think_s)
    out.sort(key=lambda r: r.arrival_s)
    return out


@dataclass(frozen=True, slots=True)
class ColdSpec:
    requests: int = 4000
    rate_per_s: float = 12.0
    prompt_tokens: tuple[int, int] = (256, 16384)
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (256, 1024)
    system_probability: float = 0.2
    output_tokens: tuple[int, int] = (16, 512)
    seed: int = 13


def cold_one_offs(spec: ColdSpec | None = None) -> list[ReplayRequest]:
    s = spec or ColdSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(_blocks(_tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    out, t = [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        prompt = list(systems[rng.randrange(s.system_prompts)]) if (
            rng.random() < s.system_probability) else []
        prompt += ids.take(_blocks(_tokens(rng, *s.prompt_tokens)))
        out.append(_request(t, prompt, _tokens(rng, *s.output_tokens)))
    return out


@dataclass(frozen=True, slots=True)
class BurstSpec:
    duration_s: float = 600.0
    burst_every_s: float = 4.0  # mean gap between bursts (exponential)
    burst_size: tuple[int, int] = (4, 48)
    steady_rate_per_s: float = 2.0
    conversations: int = 400
    system_tokens: tuple[int, int] = (1024, 4096)
    turn_tokens: tuple[int, int] = (64, 1024)
    documents: int = 400
    document_tokens: tuple[int, int] = (2048, 12288)
    cold_tokens: tuple[int, int] = (512, 8192)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 14


def bursts(spec: BurstSpec | None = None) -> list[ReplayRequest]:
    """Each request is a conversation's next turn (40 %), a question on a shared document
    (30 %) or a cold prompt (30 %)."""
    s = spec or BurstSpec()
    rng, ids = random.Random(s.seed), IdSource()
    system = ids.take(_blocks(_tokens(rng, *s.system_tokens)))
    histories = [list(system) for _ in range(s.conversations)]
    docs = [ids.take(_blocks(_tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    doc = _zipf(rng, s.documents, 1.0)
    times: list[float] = []
    t = 0.0
    while t < s.duration_s:
        t += rng.expovariate(1.0 / s.burst_every_s)
        times += [t] * rng.randint(*s.burst_size)
    t = 0.0
    while t < s.duration_s:
        t += rng.expovariate(s.steady_rate_per_s)
        times.append(t)
    out = []
    for t in sorted(times):
        answer = _tokens(rng, *s.output_tokens)
        kind = rng.random()
        if kind < 0.4:
            history = histories[rng.randrange(s.conversations)]
            history += ids.take(_blocks(_tokens(rng, *s.turn_tokens)))
            out.append(_request(t, history, answer))
            history += ids.take(_blocks(answer))
        elif kind < 0.7:
            prompt = system + docs[doc()] + ids.take(_blocks(_tokens(rng, *s.turn_tokens)))
            out.append(_request(t, prompt, answer))
        else:
            out.append(_request(t, ids.take(_blocks(_tokens(rng, *s.cold_tokens))), answer))
    return out


WORKLOADS: Mapping[str, Callable[[], list[ReplayRequest]]] = MappingProxyType({
    "hot-prefixes": hot_prefixes,
    "agent-loops": agent_loops,
    "cold-one-offs": cold_one_offs,
    "bursts": bursts,
    "rag-corpus": rag_corpus,
    "skewed-tenants": skewed_tenants,
    "load-ramp": load_ramp,
    "heavy-tail": heavy_tail,
    "long-context": long_context,
    "prefix-tree": prefix_tree,
    "salted-tenants": salted_tenants,
    "decode-mix": decode_mix,
})

SEEDED: Mapping[str, Callable[[int], list[ReplayRequest]]] = MappingProxyType({
    "hot-prefixes": lambda seed: hot_prefixes(HotPrefixSpec(seed=seed)),
    "agent-loops": lambda seed: agent_loops(AgentSpec(seed=seed)),
    "cold-one-offs": lambda seed: cold_one_offs(ColdSpec(seed=seed)),
    "bursts": lambda seed: bursts(BurstSpec(seed=seed)),
    "rag-corpus": lambda seed: rag_corpus(RagSpec(seed=seed)),
    "skewed-tenants": lambda seed: skewed_tenants(SkewSpec(seed=seed)),
    "load-ramp": lambda seed: load_ramp(RampSpec(seed=seed)),
    "heavy-tail": lambda seed: heavy_tail(HeavyTailSpec(seed=seed)),
    "long-context": lambda seed: long_context(LongContextSpec(seed=seed)),
    "prefix-tree": lambda seed: prefix_tree(PrefixTreeSpec(seed=seed)),
    "salted-tenants": lambda seed: salted_tenants(SaltedSpec(seed=seed)),
    "decode-mix": lambda seed: decode_mix(DecodeMixSpec(seed=seed)),
})

DEFAULT_SEEDS: Mapping[str, int] = MappingProxyType({
    "hot-prefixes": HotPrefixSpec().seed,
    "agent-loops": AgentSpec().seed,
    "cold-one-offs": ColdSpec().seed,
    "bursts": BurstSpec().seed,
    "rag-corpus": RagSpec().seed,
    "skewed-tenants": SkewSpec().seed,
    "load-ramp": RampSpec().seed,
    "heavy-tail": HeavyTailSpec().seed,
    "long-context": LongContextSpec().seed,
    "prefix-tree": PrefixTreeSpec().seed,
    "salted-tenants": SaltedSpec().seed,
    "decode-mix": DecodeMixSpec().seed,
})
