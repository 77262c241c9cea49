"""Three more unseen shapes: tool agents, a drifting mix of every kind, a day with a flash crowd.

Seeded and deterministic like `loadtest.replay.unseen`, which registers them (kept out of
`generators.WORKLOADS` for the same reason):

- `tool_agent`: tool-calling agents as in the tool&agent trace the Mooncake paper published
  (one hour, ~23.6k requests; mean input ~8.6k tokens, mean output ~180, ~59 % of the input
  tokens reusable). A session starts on one of a few long tool / system preambles (thousands
  of tokens of tool schemas, Zipf-popular: a handful of agent products serve most sessions),
  then makes 5-30 calls in quick succession, each call's prompt the last one plus the model's
  short answer and a tool result. Sessions come in bursts: an orchestrator often launches
  several sub-agents at once on the same preamble and task. Beside them, single tool calls on
  a preamble with a fresh payload (a document to extract from) that nobody reuses.
- `fleet_mix`: the traffic one shared fleet serves: chat conversations, RAG questions over a
  shared corpus, agent loops and one-off prompts arriving together, the mix drifting over the
  run (chat-heavy at the start, agent-heavy at the end, as a product's usage shifts over a
  day). A routing tuned to one kind must not lose the others: the agents' growing contexts
  and the corpus compete for the same caches as the conversations' histories.
- `flash_crowd`: a day's load swing compressed into minutes (arrivals from a trough of a
  quarter of the peak, up and down again), RAG and chat, and past the peak a flash crowd: a
  prefix nobody sent before (a launch announcement's prompt, a viral shared document) takes
  an extra half of the traffic for ~40 s. One prefix is then more than one replica can
  serve: it must be copied for load, to as few replicas as that needs, and the copies let go
  when the crowd leaves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.replay.draws import BLOCK, blocks, request, tokens, zipf
from loadtest.replay.workload import IdSource, ReplayRequest

__all__ = [
    "KINDS", "CrowdSpec", "FleetMixSpec", "ToolAgentSpec", "crowd_rate", "day_rate", "flash_crowd",
    "flash_crowd_drawn", "fleet_mix", "fleet_mix_drawn", "mix_weights", "tool_agent",
]


@dataclass(frozen=True, slots=True)
class ToolAgentSpec:
    duration_s: float = 240.0  # sessions start over the first 5/6, then finish
    launch_rate_per_s: float = 0.35  # an orchestrator's launch: one session or several
    fanout_probability: float = 0.3  # a launch of several sub-agents at once
    fanout: tuple[int, int] = (2, 6)
    preambles: int = 10  # agent products: tool schemas and system prompt
    preamble_tokens: tuple[int, int] = (1536, 6144)
    preamble_zipf: float = 1.0
    task_tokens: tuple[int, int] = (128, 1024)  # the session's task, shared by its sub-agents
    calls: tuple[int, int] = (5, 30)
    tool_result_tokens: tuple[int, int] = (64, 1536)
    output_tokens: tuple[int, int] = (24, 512)  # tool calls: short
    tool_latency_s: tuple[float, float] = (0.2, 2.0)  # from an answer to the next call
    decode_tokens_per_s: float = 80.0  # an answer's generation, before its tool runs
    max_context_tokens: int = 48_000
    single_rate_per_s: float = 6.0  # one-off tool calls: a preamble and a fresh payload
    single_tokens: tuple[int, int] = (1024, 12_288)
    seed: int = 51


def tool_agent(spec: ToolAgentSpec | None = None) -> list[ReplayRequest]:
    s = spec or ToolAgentSpec()
    rng, ids = random.Random(s.seed), IdSource()
    preambles = [ids.take(blocks(tokens(rng, *s.preamble_tokens))) for _ in range(s.preambles)]
    preamble = zipf(rng, s.preambles, s.preamble_zipf)
    out: list[ReplayRequest] = []
    start = 0.0
    while True:
        start += rng.expovariate(s.launch_rate_per_s)
        if start > s.duration_s * 5 / 6:
            break
        fanout = rng.randint(*s.fanout) if rng.random() < s.fanout_probability else 1
        shared = preambles[preamble()] + ids.take(blocks(tokens(rng, *s.task_tokens)))
        for _ in range(fanout):
            out += _session(rng, ids, s, start + rng.uniform(0.0, 0.05), shared)
    t = 0.0
    while True:
        t += rng.expovariate(s.single_rate_per_s)
        if t > s.duration_s:
            break
        prompt = preambles[preamble()] + ids.take(blocks(tokens(rng, *s.single_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens)))
    out.sort(key=lambda r: r.arrival_s)
    return out


def _session(rng: random.Random, ids: IdSource, s: ToolAgentSpec, t: float,
             context: list[int]) -> list[ReplayRequest]:
    """One agent's calls: each the last prompt plus its answer and the tool's result, the next
    arriving when the answer is generated and the tool has run."""
    out = []
    for _ in range(rng.randint(*s.calls)):
        answer = tokens(rng, *s.output_tokens)
        out.append(request(t, context, answer))
        context = context + ids.take(blocks(answer + tokens(rng, *s.tool_result_tokens)))
        if len(context) * BLOCK > s.max_context_tokens:
            break
        t += answer / s.decode_tokens_per_s + rng.uniform(*s.tool_latency_s)
    return out


KINDS = ("chat", "rag", "agent", "one-off")


@dataclass(frozen=True, slots=True)
class FleetMixSpec:
    duration_s: float = 300.0
    rate_per_s: float = 12.0
    start_mix: tuple[float, float, float, float] = (0.45, 0.25, 0.10, 0.20)  # as `KINDS`
    end_mix: tuple[float, float, float, float] = (0.15, 0.30, 0.40, 0.15)
    chat_systems: int = 4
    chat_system_tokens: tuple[int, int] = (512, 3072)
    open_chats: int = 80  # conversations in progress
    chat_continue: float = 0.75
    chat_turn_tokens: tuple[int, int] = (32, 1024)
    rag_system_tokens: tuple[int, int] = (1024, 2048)
    documents: int = 600
    document_tokens: tuple[int, int] = (2048, 12_288)
    document_zipf: float = 0.9
    question_tokens: tuple[int, int] = (32, 512)
    agent_preambles: int = 5
    agent_preamble_tokens: tuple[int, int] = (2048, 8192)
    open_agents: int = 30
    agent_continue: float = 0.85
    tool_result_tokens: tuple[int, int] = (64, 2048)
    max_context_tokens: int = 48_000
    one_off_tokens: tuple[int, int] = (256, 16_384)
    output_tokens: tuple[int, int] = (24, 768)
    seed: int = 52


def mix_weights(s: FleetMixSpec, t: float) -> list[float]:
    """Each kind's share at time ``t``: drifting linearly from `start_mix` to `end_mix`."""
    x = min(1.0, max(0.0, t / s.duration_s))
    return [a + (b - a) * x for a, b in zip(s.start_mix, s.end_mix, strict=True)]


def fleet_mix(spec: FleetMixSpec | None = None) -> list[ReplayRequest]:
    return fleet_mix_drawn(spec)[0]


def fleet_mix_drawn(spec: FleetMixSpec | None = None) -> tuple[list[ReplayRequest], list[str]]:
    """`fleet_mix`'s requests and each one's kind (`KINDS`)."""
    s = spec or FleetMixSpec()
    rng, ids = random.Random(s.seed), IdSource()
    chat_systems = [ids.take(blocks(tokens(rng, *s.chat_system_tokens)))
                    for _ in range(s.chat_systems)]
    rag_system = ids.take(blocks(tokens(rng, *s.rag_system_tokens)))
    docs = [ids.take(blocks(tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    doc = zipf(rng, s.documents, s.document_zipf)
    preambles = [ids.take(blocks(tokens(rng, *s.agent_preamble_tokens)))
                 for _ in range(s.agent_preambles)]
    chats: list[list[int]] = []
    agents: list[list[int]] = []
    out: list[ReplayRequest] = []
    kinds: list[str] = []
    t = 0.0
    while True:
        t += rng.expovariate(s.rate_per_s)
        if t > s.duration_s:
            return out, kinds
        kind = rng.choices(KINDS, weights=mix_weights(s, t))[0]
        answer = tokens(rng, *s.output_tokens)
        if kind == "chat":
            prompt = _continued(rng, chats, s.chat_continue, s.open_chats,
                                lambda: list(chat_systems[rng.randrange(s.chat_systems)]))
            prompt += ids.take(blocks(tokens(rng, *s.chat_turn_tokens)))
            chats.append(prompt + ids.take(blocks(answer)))
        elif kind == "rag":
            prompt = rag_system + docs[doc()] + ids.take(blocks(tokens(rng, *s.question_tokens)))
        elif kind == "agent":
            prompt = _continued(rng, agents, s.agent_continue, s.open_agents,
                                lambda: list(preambles[rng.randrange(s.agent_preambles)]))
            if len(prompt) * BLOCK > s.max_context_tokens:  # the agent ends, another starts
                prompt = list(preambles[rng.randrange(s.agent_preambles)])
            prompt += ids.take(blocks(tokens(rng, *s.tool_result_tokens)))
            agents.append(prompt + ids.take(blocks(answer)))
        else:
            prompt = ids.take(blocks(tokens(rng, *s.one_off_tokens)))
        out.append(request(t, prompt, answer))
        kinds.append(kind)


def _continued(rng: random.Random, open_: list[list[int]], p: float, most: int,
               new: Callable[[], list[int]]) -> list[int]:
    """An open history taken out of ``open_`` (with probability ``p``), else ``new()`` (the
    oldest open one dropped when ``most`` are open)."""
    if open_ and rng.random() < p:
        return open_.pop(rng.randrange(len(open_)))
    if len(open_) >= most:
        open_.pop(0)
    return new()


@dataclass(frozen=True, slots=True)
class CrowdSpec:
    duration_s: float = 300.0
    trough_rate_per_s: float = 4.0  # the day's arrivals, at the start and the end
    peak_rate_per_s: float = 16.0  # at the middle
    crowd_start_s: float = 170.0
    crowd_ramp_s: float = 5.0  # up to its rate, then held, then down over twice this
    crowd_hold_s: float = 25.0
    crowd_rate_per_s: float = 14.0
    crowd_prefix_tokens: tuple[int, int] = (4096, 8192)
    crowd_question_tokens: tuple[int, int] = (32, 256)
    systems: int = 3
    system_tokens: tuple[int, int] = (512, 2048)
    documents: int = 400
    document_tokens: tuple[int, int] = (2048, 12_288)
    document_zipf: float = 1.0
    rag_probability: float = 0.6  # else a conversation's turn
    open_chats: int = 80
    chat_turn_tokens: tuple[int, int] = (32, 1024)
    question_tokens: tuple[int, int] = (32, 512)
    output_tokens: tuple[int, int] = (24, 512)
    seed: int = 53


def day_rate(s: CrowdSpec, t: float) -> float:
    """The day's arrival rate at ``t``: a cosine from the trough to the peak and back."""
    swing = (1.0 - math.cos(2.0 * math.pi * t / s.duration_s)) / 2.0
    return s.trough_rate_per_s + (s.peak_rate_per_s - s.trough_rate_per_s) * swing


def crowd_rate(s: CrowdSpec, t: float) -> float:
    """The flash crowd's extra arrivals at ``t`` (0 outside it)."""
    x = t - s.crowd_start_s
    if x < 0.0:
        return 0.0
    if x < s.crowd_ramp_s:
        return s.crowd_rate_per_s * x / s.crowd_ramp_s
    x -= s.crowd_ramp_s + s.crowd_hold_s
    if x < 0.0:
        return s.crowd_rate_per_s
    return max(0.0, s.crowd_rate_per_s * (1.0 - x / (2.0 * s.crowd_ramp_s)))


def flash_crowd(spec: CrowdSpec | None = None) -> list[ReplayRequest]:
    return flash_crowd_drawn(spec)[0]


def flash_crowd_drawn(spec: CrowdSpec | None = None) -> tuple[list[ReplayRequest], list[bool]]:
    """`flash_crowd`'s requests and, for each, whether it is one of the crowd's. Arrivals by
    thinning: candidates at the highest rate, each kept with its time's rate over that."""
    s = spec or CrowdSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.systems)]
    docs = [ids.take(blocks(tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    doc = zipf(rng, s.documents, s.document_zipf)
    crowd = ids.take(blocks(tokens(rng, *s.crowd_prefix_tokens)))
    top = s.peak_rate_per_s + s.crowd_rate_per_s
    chats: list[list[int]] = []
    out: list[ReplayRequest] = []
    flags: list[bool] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t > s.duration_s:
            return out, flags
        u, day, extra = rng.random() * top, day_rate(s, t), crowd_rate(s, t)
        if u >= day + extra:
            continue
        answer = tokens(rng, *s.output_tokens)
        if u >= day:  # the crowd's
            prompt = crowd + ids.take(blocks(tokens(rng, *s.crowd_question_tokens)))
        elif rng.random() < s.rag_probability:
            prompt = systems[0] + docs[doc()] + ids.take(blocks(tokens(rng, *s.question_tokens)))
        else:
            prompt = _continued(rng, chats, 0.7, s.open_chats,
                                lambda: list(systems[1 + rng.randrange(s.systems - 1)]))
            prompt += ids.take(blocks(tokens(rng, *s.chat_turn_tokens)))
            chats.append(prompt + ids.take(blocks(answer)))
        out.append(request(t, prompt, answer))
        flags.append(u >= day)
