"""Workload shapes kvgate's routing was not tuned on (issue 11: quality on unseen traffic).

Seeded and deterministic like `loadtest.replay.generators` (which registers them):

- `rag_corpus`: retrieval over a large document set: a few system prompts, thousands of
  medium documents (2k-20k tokens) with Zipf-skewed reuse, a short question on top. The
  documents asked about often add up to more than one replica's cache and less than the
  fleet's.
- `skewed_tenants`: one tenant sends ~75 % of the traffic, many small tenants the rest; each
  has its own system prompt and conversations, salted per tenant (`ReplayRequest.tenant`:
  different tenants' prompts never share a block).
- `load_ramp`: shared-prefix traffic whose rate rises linearly from light to past the
  fleet's capacity and falls back (a non-homogeneous Poisson process, drawn by thinning).
- `heavy_tail`: mostly short prompts on a few system prompts, and rare 60k-120k-token
  prompts that share nothing: one long prefill holds its replica for seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.replay.draws import blocks, request, tokens, zipf
from loadtest.replay.workload import IdSource, ReplayRequest

__all__ = [
    "HeavyTailSpec", "RagSpec", "RampSpec", "SkewSpec", "heavy_tail", "load_ramp", "rag_corpus",
    "rag_drawn", "ramp_rate", "skewed_tenants",
]


@dataclass(frozen=True, slots=True)
class RagSpec:
    requests: int = 3000
    rate_per_s: float = 10.0
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (512, 2048)
    documents: int = 3000
    document_tokens: tuple[int, int] = (2048, 20480)
    zipf: float = 1.0
    question_tokens: tuple[int, int] = (16, 256)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 21


def rag_corpus(spec: RagSpec | None = None) -> list[ReplayRequest]:
    """Each request: a system prompt (uniform), a document (Zipf), a new short question."""
    return rag_drawn(spec)[0]


def rag_drawn(
    spec: RagSpec | None = None,
) -> tuple[list[ReplayRequest], list[int], list[list[int]]]:
    """`rag_corpus`'s requests, each one's document (an index), and the documents' blocks."""
    s = spec or RagSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    docs = [ids.take(blocks(tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    doc = zipf(rng, s.documents, s.zipf)
    out, chosen, t = [], [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        system = systems[rng.randrange(s.system_prompts)]
        d = doc()
        prompt = system + docs[d]
        prompt = prompt + ids.take(blocks(tokens(rng, *s.question_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens)))
        chosen.append(d)
    return out, chosen, docs


@dataclass(frozen=True, slots=True)
class SkewSpec:
    requests: int = 4000
    rate_per_s: float = 16.0
    top_share: float = 0.75  # of all requests, the top tenant's
    small_tenants: int = 24  # the rest of the traffic, uniformly
    system_tokens: tuple[int, int] = (1024, 6144)
    continue_probability: float = 0.6  # a request continues one of its tenant's conversations
    open_conversations: int = 24  # per tenant: a new one retires the oldest
    turns: int = 10  # a conversation's last turn
    turn_tokens: tuple[int, int] = (64, 1024)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 22


def skewed_tenants(spec: SkewSpec | None = None) -> list[ReplayRequest]:
    """Tenant ``tenant-0`` sends ``top_share`` of the requests; a request opens a conversation
    on its tenant's system prompt or continues one of the tenant's open ones (the history, the
    last answer and a new user turn)."""
    s = spec or SkewSpec()
    rng, ids = random.Random(s.seed), IdSource()
    n = 1 + s.small_tenants
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(n)]
    # per tenant: open conversations as (history, turns so far)
    open_: list[list[tuple[list[int], int]]] = [[] for _ in range(n)]
    out, t = [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        k = 0 if rng.random() < s.top_share else 1 + rng.randrange(s.small_tenants)
        convs = open_[k]
        if convs and rng.random() < s.continue_probability:
            i = rng.randrange(len(convs))
            history, turn = convs[i]
        else:
            if len(convs) >= s.open_conversations:
                convs.pop(0)
            i, history, turn = len(convs), list(systems[k]), 0
            convs.append((history, turn))
        history = history + ids.take(blocks(tokens(rng, *s.turn_tokens)))
        answer = tokens(rng, *s.output_tokens)
        out.append(request(t, history, answer, tenant=f"tenant-{k}"))
        if turn + 1 >= s.turns:
            convs.pop(i)
        else:
            convs[i] = (history + ids.take(blocks(answer)), turn + 1)
    return out


@dataclass(frozen=True, slots=True)
class RampSpec:
    duration_s: float = 240.0
    low_rate_per_s: float = 4.0  # at the start and the end
    peak_rate_per_s: float = 32.0  # half-way
    system_prompts: int = 6
    system_tokens: tuple[int, int] = (1024, 4096)
    documents: int = 1500
    document_tokens: tuple[int, int] = (4096, 16384)
    document_probability: float = 0.8
    zipf: float = 0.9
    question_tokens: tuple[int, int] = (64, 1024)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 23


def ramp_rate(s: RampSpec, t: float) -> float:
    """The arrival rate at ``t``: linear from the low rate to the peak at half the duration,
    and back (0 outside the run)."""
    if not 0.0 <= t <= s.duration_s:
        return 0.0
    up = 1.0 - abs(2.0 * t / s.duration_s - 1.0)
    return s.low_rate_per_s + (s.peak_rate_per_s - s.low_rate_per_s) * up


def load_ramp(spec: RampSpec | None = None) -> list[ReplayRequest]:
    """Questions on a system prompt and, mostly, a Zipf-popular document, arriving at
    `ramp_rate` (candidates at the peak rate, each kept with probability rate / peak)."""
    s = spec or RampSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    docs = [ids.take(blocks(tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    system, doc = zipf(rng, s.system_prompts, s.zipf), zipf(rng, s.documents, s.zipf)
    out: list[ReplayRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(s.peak_rate_per_s)
        if t > s.duration_s:
            return out
        if rng.random() * s.peak_rate_per_s > ramp_rate(s, t):
            continue
        prompt = list(systems[system()])
        if rng.random() < s.document_probability:
            prompt += docs[doc()]
        prompt += ids.take(blocks(tokens(rng, *s.question_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens)))


@dataclass(frozen=True, slots=True)
class HeavyTailSpec:
    requests: int = 4000
    rate_per_s: float = 32.0
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (512, 2048)
    system_probability: float = 0.6
    short_tokens: tuple[int, int] = (128, 4096)
    long_probability: float = 0.004  # few enough that p99 is mostly short requests
    long_tokens: tuple[int, int] = (61_440, 122_880)
    output_tokens: tuple[int, int] = (32, 384)
    seed: int = 24


def heavy_tail(spec: HeavyTailSpec | None = None) -> list[ReplayRequest]:
    """Short prompts (often on a shared system prompt) and, with ``long_probability``, a
    60k-120k-token prompt that shares nothing."""
    s = spec or HeavyTailSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    out, t = [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        if rng.random() < s.long_probability:
            prompt = ids.take(blocks(rng.randint(*s.long_tokens)))
        else:
            prompt = list(systems[rng.randrange(s.system_prompts)]) if (
                rng.random() < s.system_probability) else []
            prompt += ids.take(blocks(tokens(rng, *s.short_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens)))
    return out
