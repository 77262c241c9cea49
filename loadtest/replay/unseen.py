"""Ten more traffic shapes routing was not tuned on, kept out of the main benchmark's matrix.

Seeded and deterministic like `loadtest.replay.shapes`; `UNSEEN` names them for
`kvgate replay --workload` and `loadtest.bench_replay_unseen` (not `generators.WORKLOADS`,
whose every entry `loadtest.bench_replay` and the sync benchmarks replay):

- `popularity_drift`: RAG documents whose popularity shifts every `epoch_s`, as a news cycle
  or a daily batch of reports does: each epoch a few documents nobody read become the hottest
  at once (a herd on an uncached prefix) and every other one falls a few ranks, so the hot
  ones of the last epoch go nearly cold (Zipf 1.1: a fall of 6 ranks is ~8x fewer readers).
  Replicas holding the old copies must be reused for what is hot now, and the affinity index
  must follow the engines' evictions.
- `long_pauses`: chat conversations, half with pauses of seconds between turns, half whose
  user comes back minutes later, over a background of one-off prompts that turns the caches
  over faster than the long pauses at 262,144 KV tokens a replica and slower at 1,048,576. A
  returning turn's history may be listed in the index and gone from the engine.
- `huge_documents`: a few 32k-100k-token documents (contracts, codebases, books) each read by
  many short questions, beside short chat. At 262,144 KV tokens a copy fills a third to
  nearly half of a replica: two copies of the big ones do not fit on one.
- `dominant_tenant`: one tenant sends 80 % of the requests (a big customer's product: its
  system prompt and Zipf-popular documents), 30 small tenants the rest (their own prompts and
  conversations), every tenant salted (`ReplayRequest.tenant`). The big tenant's hot prefixes
  need copies for load; the small tenants' must not be crowded out of every cache.

and the three of `loadtest.replay.fleet_shapes`: `tool-agent`, `fleet-mix`, `flash-crowd`, and
the three of `loadtest.replay.pressure_shapes`: `long-answers`, `giant-sessions`,
`tenant-surge`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from loadtest.replay.draws import blocks, request, tokens, zipf
from loadtest.replay.fleet_shapes import (
    CrowdSpec,
    FleetMixSpec,
    ToolAgentSpec,
    flash_crowd,
    fleet_mix,
    tool_agent,
)
from loadtest.replay.pressure_shapes import (
    GiantSpec,
    LongAnswerSpec,
    SurgeSpec,
    giant_sessions,
    long_answers,
    tenant_surge,
)
from loadtest.replay.workload import IdSource, ReplayRequest

__all__ = [
    "UNSEEN", "UNSEEN_SEEDED", "UNSEEN_SEEDS", "DominantSpec", "DriftSpec", "HugeDocSpec",
    "PauseSpec", "dominant_tenant", "drift_doc", "huge_documents", "long_pauses",
    "long_pauses_drawn", "popularity_drift", "popularity_drift_drawn",
]


@dataclass(frozen=True, slots=True)
class DriftSpec:
    duration_s: float = 240.0
    rate_per_s: float = 11.0
    epoch_s: float = 40.0  # popularity shifts this often
    shift: int = 6  # ranks each document falls per epoch; the `shift` coldest become the top
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (512, 2048)
    documents: int = 240
    document_tokens: tuple[int, int] = (4096, 16_384)
    zipf: float = 1.1
    question_tokens: tuple[int, int] = (32, 512)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 41


def drift_doc(s: DriftSpec, rank: int, t: float) -> int:
    """The document at popularity ``rank`` at time ``t``: every epoch each document falls
    `shift` ranks and the `shift` coldest rise to the top (cold to hot at once)."""
    epoch = int(t // s.epoch_s)
    return (rank - epoch * s.shift) % s.documents


def popularity_drift(spec: DriftSpec | None = None) -> list[ReplayRequest]:
    """Each request: a system prompt (uniform), the document at a Zipf-drawn rank of the
    current epoch, a new question."""
    return popularity_drift_drawn(spec)[0]


def popularity_drift_drawn(spec: DriftSpec | None = None) -> tuple[list[ReplayRequest], list[int]]:
    """`popularity_drift`'s requests and each one's document (an index)."""
    s = spec or DriftSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    docs = [ids.take(blocks(tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    rank = zipf(rng, s.documents, s.zipf)
    out: list[ReplayRequest] = []
    chosen: list[int] = []
    t = 0.0
    while True:
        t += rng.expovariate(s.rate_per_s)
        if t > s.duration_s:
            return out, chosen
        d = drift_doc(s, rank(), t)
        prompt = systems[rng.randrange(s.system_prompts)] + docs[d]
        prompt = prompt + ids.take(blocks(tokens(rng, *s.question_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens)))
        chosen.append(d)


@dataclass(frozen=True, slots=True)
class PauseSpec:
    duration_s: float = 600.0
    conversation_rate_per_s: float = 0.8  # new conversations, over the first 3/5 of the run
    long_probability: float = 0.5  # a conversation whose user pauses for minutes
    turns: tuple[int, int] = (4, 10)
    short_pause_s: tuple[float, float] = (2.0, 12.0)
    long_pause_s: tuple[float, float] = (60.0, 240.0)
    system_prompts: int = 2
    system_tokens: tuple[int, int] = (1024, 3072)
    turn_tokens: tuple[int, int] = (256, 3072)  # a user turn (pasted text, a file)
    answer_tokens: tuple[int, int] = (64, 768)
    background_rate_per_s: float = 3.0  # one-off prompts that churn the caches
    background_tokens: tuple[int, int] = (4096, 16_384)
    seed: int = 42


def long_pauses(spec: PauseSpec | None = None) -> list[ReplayRequest]:
    return long_pauses_drawn(spec)[0]


def long_pauses_drawn(
    spec: PauseSpec | None = None,
) -> tuple[list[ReplayRequest], list[float | None]]:
    """`long_pauses`' requests and, for each, the pause before it since its conversation's
    previous turn arrived (None: a first turn or a background prompt)."""
    s = spec or PauseSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    drawn: list[tuple[float, ReplayRequest, float | None]] = []
    start = 0.0
    while True:
        start += rng.expovariate(s.conversation_rate_per_s)
        if start > s.duration_s * 3 / 5:
            break
        pauses = s.long_pause_s if rng.random() < s.long_probability else s.short_pause_s
        history = list(systems[rng.randrange(s.system_prompts)])
        t, pause = start, None
        for _ in range(rng.randint(*s.turns)):
            history += ids.take(blocks(tokens(rng, *s.turn_tokens)))
            answer = tokens(rng, *s.answer_tokens)
            drawn.append((t, request(t, history, answer), pause))
            history = history + ids.take(blocks(answer))
            pause = rng.uniform(*pauses)
            t += pause
            if t > s.duration_s:
                break
    t = 0.0
    while True:
        t += rng.expovariate(s.background_rate_per_s)
        if t > s.duration_s:
            break
        prompt = ids.take(blocks(tokens(rng, *s.background_tokens)))
        drawn.append((t, request(t, prompt, tokens(rng, *s.answer_tokens)), None))
    drawn.sort(key=lambda x: x[0])
    return [r for _, r, _ in drawn], [p for _, _, p in drawn]


@dataclass(frozen=True, slots=True)
class HugeDocSpec:
    requests: int = 2400
    rate_per_s: float = 14.0
    documents: int = 8
    document_tokens: tuple[int, int] = (32_768, 102_400)
    zipf: float = 1.0
    document_probability: float = 0.5  # a question on a document; else short chat
    question_tokens: tuple[int, int] = (16, 256)
    system_prompts: int = 2
    system_tokens: tuple[int, int] = (256, 1024)
    chat_tokens: tuple[int, int] = (64, 2048)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 43


def huge_documents(spec: HugeDocSpec | None = None) -> list[ReplayRequest]:
    """A short question on a Zipf-popular huge document, or short chat."""
    s = spec or HugeDocSpec()
    rng, ids = random.Random(s.seed), IdSource()
    # log-uniform would put most documents near 32k: uniform sizes give several near 100k
    docs = [ids.take(blocks(rng.randint(*s.document_tokens))) for _ in range(s.documents)]
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    doc = zipf(rng, s.documents, s.zipf)
    out, t = [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        if rng.random() < s.document_probability:
            prompt = docs[doc()] + ids.take(blocks(tokens(rng, *s.question_tokens)))
        else:
            prompt = systems[rng.randrange(s.system_prompts)] + ids.take(
                blocks(tokens(rng, *s.chat_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens)))
    return out


@dataclass(frozen=True, slots=True)
class DominantSpec:
    requests: int = 3000
    rate_per_s: float = 14.0
    top_share: float = 0.8
    small_tenants: int = 30
    top_system_tokens: tuple[int, int] = (4096, 6144)
    top_documents: int = 400  # the big tenant's, Zipf
    document_tokens: tuple[int, int] = (2048, 8192)
    zipf: float = 1.0
    small_system_tokens: tuple[int, int] = (1024, 4096)
    continue_probability: float = 0.7  # a small tenant's request continues a conversation
    open_conversations: int = 6  # per small tenant
    input_tokens: tuple[int, int] = (32, 768)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 44


def dominant_tenant(spec: DominantSpec | None = None) -> list[ReplayRequest]:
    """``tenant-0`` (``top_share``): its system prompt, a Zipf document, a question; a small
    tenant: a new or continued conversation on its own system prompt."""
    s = spec or DominantSpec()
    rng, ids = random.Random(s.seed), IdSource()
    top_system = ids.take(blocks(tokens(rng, *s.top_system_tokens)))
    docs = [ids.take(blocks(tokens(rng, *s.document_tokens))) for _ in range(s.top_documents)]
    systems = [ids.take(blocks(tokens(rng, *s.small_system_tokens)))
               for _ in range(s.small_tenants)]
    convs: list[list[list[int]]] = [[] for _ in range(s.small_tenants)]
    doc = zipf(rng, s.top_documents, s.zipf)
    out, t = [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        answer = tokens(rng, *s.output_tokens)
        question = ids.take(blocks(tokens(rng, *s.input_tokens)))
        if rng.random() < s.top_share:
            out.append(request(t, top_system + docs[doc()] + question, answer, "tenant-0"))
            continue
        k = rng.randrange(s.small_tenants)
        open_ = convs[k]
        if open_ and rng.random() < s.continue_probability:
            history = open_.pop(rng.randrange(len(open_)))
        else:
            history = list(systems[k])
            if len(open_) >= s.open_conversations:
                open_.pop(0)
        history = history + question
        out.append(request(t, history, answer, f"tenant-{k + 1}"))
        open_.append(history + ids.take(blocks(answer)))
    return out


UNSEEN_SEEDED: Mapping[str, Callable[[int], list[ReplayRequest]]] = MappingProxyType({
    "popularity-drift": lambda seed: popularity_drift(DriftSpec(seed=seed)),
    "long-pauses": lambda seed: long_pauses(PauseSpec(seed=seed)),
    "huge-documents": lambda seed: huge_documents(HugeDocSpec(seed=seed)),
    "dominant-tenant": lambda seed: dominant_tenant(DominantSpec(seed=seed)),
    "tool-agent": lambda seed: tool_agent(ToolAgentSpec(seed=seed)),
    "fleet-mix": lambda seed: fleet_mix(FleetMixSpec(seed=seed)),
    "flash-crowd": lambda seed: flash_crowd(CrowdSpec(seed=seed)),
    "long-answers": lambda seed: long_answers(LongAnswerSpec(seed=seed)),
    "giant-sessions": lambda seed: giant_sessions(GiantSpec(seed=seed)),
    "tenant-surge": lambda seed: tenant_surge(SurgeSpec(seed=seed)),
})

UNSEEN_SEEDS: Mapping[str, int] = MappingProxyType({
    "popularity-drift": DriftSpec().seed,
    "long-pauses": PauseSpec().seed,
    "huge-documents": HugeDocSpec().seed,
    "dominant-tenant": DominantSpec().seed,
    "tool-agent": ToolAgentSpec().seed,
    "fleet-mix": FleetMixSpec().seed,
    "flash-crowd": CrowdSpec().seed,
    "long-answers": LongAnswerSpec().seed,
    "giant-sessions": GiantSpec().seed,
    "tenant-surge": SurgeSpec().seed,
})

UNSEEN: Mapping[str, Callable[[], list[ReplayRequest]]] = MappingProxyType({
    "popularity-drift": popularity_drift,
    "long-pauses": long_pauses,
    "huge-documents": huge_documents,
    "dominant-tenant": dominant_tenant,
    "tool-agent": tool_agent,
    "fleet-mix": fleet_mix,
    "flash-crowd": flash_crowd,
    "long-answers": long_answers,
    "giant-sessions": giant_sessions,
    "tenant-surge": tenant_surge,
})
