"""Three more unseen shapes: long answers, giant sessions among chat, one salted tenant's surge.

Seeded and deterministic like `loadtest.replay.unseen`, which registers them (kept out of
`generators.WORKLOADS` for the same reason). Each is a shape the other workloads lack:

- `long_answers`: writing and coding assistants: conversations of short user turns whose
  answers are 1k-4k tokens long, each next turn carrying the earlier answers in its history
  (`decode-mix`'s long answers are one-off: here the KV memory fills from decode and the
  prefixes worth keeping are the decoded text itself). Prefill is small; what a placement
  decides is mostly how many long decodes each replica carries, and whether a conversation's
  next turn finds its history where the KV memory has not been taken by other decodes.
- `giant_sessions`: a few sessions over a 96k-116k-token context (a repository, a book, a
  long transcript: each a few calls minutes apart, growing a little each call) among many
  short chat conversations. At 262,144 KV tokens one such context takes 40-45 % of a replica,
  so every copy of one evicts hundreds of chat histories, and a call moved off its context's
  holder costs seconds of prefill (`huge-documents`' contexts are few and read all the time;
  these are read a few times each, then never again).
- `tenant_surge`: 40 salted tenants of one product, one system prompt text and the same few
  tool blocks (a cache copy per tenant, as `salted-tenants`), and then one tenant of the
  tail, its prefix cold, sends 5x the top tenant's rate for 40 s (a batch job, a launch): one
  salted prefix must be copied for load at once, to as few replicas as that needs, while the
  other tenants' copies stay.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.replay.draws import BLOCK, blocks, request, tokens, zipf
from loadtest.replay.fleet_shapes import _continued
from loadtest.replay.workload import IdSource, ReplayRequest

__all__ = [
    "GiantSpec", "LongAnswerSpec", "SurgeSpec", "giant_sessions", "giant_sessions_drawn",
    "long_answers", "surge_rate", "tenant_surge", "tenant_surge_drawn",
]


@dataclass(frozen=True, slots=True)
class LongAnswerSpec:
    duration_s: float = 240.0  # conversations start over the first 3/4, then finish
    conversation_rate_per_s: float = 4.0
    turns: tuple[int, int] = (1, 6)
    system_prompts: int = 4  # writing, code, chat, summaries: Zipf 1.0
    system_tokens: tuple[int, int] = (512, 2048)
    turn_tokens: tuple[int, int] = (32, 512)  # the user's turns: short
    long_probability: float = 0.8  # an answer of `long_output_tokens`, else `short_...`
    long_output_tokens: tuple[int, int] = (1024, 4096)
    short_output_tokens: tuple[int, int] = (32, 256)
    decode_tokens_per_s: float = 50.0  # an answer's generation, before the user reads it
    think_s: tuple[float, float] = (5.0, 30.0)
    max_context_tokens: int = 32_768  # the conversation ends past it
    seed: int = 61


def long_answers(spec: LongAnswerSpec | None = None) -> list[ReplayRequest]:
    """Each conversation: a system prompt, then turns of a short input and a long answer, the
    next arriving when the answer is generated and read."""
    s = spec or LongAnswerSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    system = zipf(rng, s.system_prompts, 1.0)
    out: list[ReplayRequest] = []
    start = 0.0
    while True:
        start += rng.expovariate(s.conversation_rate_per_s)
        if start > s.duration_s * 3 / 4:
            break
        history, t = list(systems[system()]), start
        for _ in range(rng.randint(*s.turns)):
            history += ids.take(blocks(tokens(rng, *s.turn_tokens)))
            long_ = rng.random() < s.long_probability
            answer = tokens(rng, *(s.long_output_tokens if long_ else s.short_output_tokens))
            out.append(request(t, history, answer))
            history = history + ids.take(blocks(answer))
            if len(history) * BLOCK > s.max_context_tokens:
                break
            t += answer / s.decode_tokens_per_s + rng.uniform(*s.think_s)
    out.sort(key=lambda r: r.arrival_s)
    return out


@dataclass(frozen=True, slots=True)
class GiantSpec:
    duration_s: float = 240.0
    chat_rate_per_s: float = 12.0
    chat_systems: int = 3
    chat_system_tokens: tuple[int, int] = (512, 2048)
    open_chats: int = 120
    chat_continue: float = 0.6
    chat_turn_tokens: tuple[int, int] = (32, 1024)
    chat_output_tokens: tuple[int, int] = (32, 512)
    session_rate_per_s: float = 0.06  # giant sessions start over the first 3/4
    context_tokens: tuple[int, int] = (98_304, 118_784)  # uniform: every one is giant
    calls: tuple[int, int] = (3, 8)
    follow_up_tokens: tuple[int, int] = (64, 512)
    call_output_tokens: tuple[int, int] = (128, 1024)
    call_gap_s: tuple[float, float] = (10.0, 40.0)  # after the answer, the next call
    decode_tokens_per_s: float = 50.0
    max_context_tokens: int = 126_976  # the session ends past it (max_model_len 131,072)
    seed: int = 62


def giant_sessions(spec: GiantSpec | None = None) -> list[ReplayRequest]:
    return giant_sessions_drawn(spec)[0]


def giant_sessions_drawn(spec: GiantSpec | None = None) -> tuple[list[ReplayRequest], list[bool]]:
    """`giant_sessions`' requests and whether each is a giant session's call."""
    s = spec or GiantSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.chat_system_tokens)))
               for _ in range(s.chat_systems)]
    drawn: list[tuple[ReplayRequest, bool]] = []
    start = 0.0
    while True:
        start += rng.expovariate(s.session_rate_per_s)
        if start > s.duration_s * 3 / 4:
            break
        context, t = ids.take(blocks(rng.randint(*s.context_tokens))), start
        for _ in range(rng.randint(*s.calls)):
            context = context + ids.take(blocks(tokens(rng, *s.follow_up_tokens)))
            answer = tokens(rng, *s.call_output_tokens)
            drawn.append((request(t, context, answer), True))
            context = context + ids.take(blocks(answer))
            if len(context) * BLOCK + s.follow_up_tokens[1] > s.max_context_tokens:
                break
            t += answer / s.decode_tokens_per_s + rng.uniform(*s.call_gap_s)
    chats: list[list[int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(s.chat_rate_per_s)
        if t > s.duration_s:
            break
        prompt = _continued(rng, chats, s.chat_continue, s.open_chats,
                            lambda: list(systems[rng.randrange(s.chat_systems)]))
        prompt += ids.take(blocks(tokens(rng, *s.chat_turn_tokens)))
        answer = tokens(rng, *s.chat_output_tokens)
        drawn.append((request(t, prompt, answer), False))
        chats.append(prompt + ids.take(blocks(answer)))
    drawn.sort(key=lambda x: x[0].arrival_s)
    return [r for r, _ in drawn], [g for _, g in drawn]


@dataclass(frozen=True, slots=True)
class SurgeSpec:
    duration_s: float = 240.0
    rate_per_s: float = 14.0  # every tenant's traffic but the surge
    tenants: int = 40
    tenant_zipf: float = 1.0  # the top tenant sends ~1/4 of it
    system_tokens: tuple[int, int] = (2048, 4096)  # one text for every tenant
    tools: int = 4
    tool_tokens: tuple[int, int] = (512, 2048)
    input_tokens: tuple[int, int] = (32, 1024)
    output_tokens: tuple[int, int] = (32, 512)
    surge_tenant: int = 30  # a tail tenant: its salted prefix is cold when the surge starts
    surge_factor: float = 5.0  # x the top tenant's rate
    surge_start_s: float = 120.0
    surge_ramp_s: float = 2.0  # sudden
    surge_hold_s: float = 40.0
    seed: int = 63


def surge_rate(s: SurgeSpec, t: float) -> float:
    """The surge tenant's extra arrivals at ``t``: 0, up in `surge_ramp_s`, held, down as
    fast."""
    top = s.rate_per_s / sum(1.0 / float(k + 1) ** s.tenant_zipf for k in range(s.tenants))
    peak: float = s.surge_factor * top
    x = t - s.surge_start_s
    if x < 0.0:
        return 0.0
    if x < s.surge_ramp_s:
        return peak * x / s.surge_ramp_s
    x -= s.surge_ramp_s + s.surge_hold_s
    if x < 0.0:
        return peak
    return max(0.0, peak * (1.0 - x / s.surge_ramp_s))


def tenant_surge(spec: SurgeSpec | None = None) -> list[ReplayRequest]:
    return tenant_surge_drawn(spec)[0]


def tenant_surge_drawn(spec: SurgeSpec | None = None) -> tuple[list[ReplayRequest], list[bool]]:
    """`tenant_surge`'s requests and whether each is one of the surge's (thinning, as
    `fleet_shapes.flash_crowd_drawn`)."""
    s = spec or SurgeSpec()
    rng, ids = random.Random(s.seed), IdSource()
    system = ids.take(blocks(tokens(rng, *s.system_tokens)))
    tools = [ids.take(blocks(tokens(rng, *s.tool_tokens))) for _ in range(s.tools)]
    tenant, tool = zipf(rng, s.tenants, s.tenant_zipf), zipf(rng, s.tools, 1.0)
    peak = s.rate_per_s + surge_rate(s, s.surge_start_s + s.surge_ramp_s)
    out: list[ReplayRequest] = []
    flags: list[bool] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t > s.duration_s:
            return out, flags
        u, extra = rng.random() * peak, surge_rate(s, t)
        if u >= s.rate_per_s + extra:
            continue
        surge = u >= s.rate_per_s
        k = s.surge_tenant if surge else tenant()
        prompt = system + tools[tool()] + ids.take(blocks(tokens(rng, *s.input_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens), tenant=f"tenant-{k}"))
        flags.append(surge)
