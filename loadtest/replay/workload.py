"""Workloads as block-id sequences: the Mooncake trace format and a synthetic multi-tenant mix.

A request's prompt is a chain of block ids of `block_tokens` tokens each (the last block may be
partial); equal ids at equal positions mean a shared prefix, exactly as in the Mooncake trace
(`hash_ids`, 512 tokens per block). Live replay renders ids to text (`loadtest.replay.text`);
offline replay feeds the ids to the engine model directly, so both see the same sharing.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtest.replay.trace import TraceError, read_rows
from loadtest.replay.trace import notes as trace_notes

__all__ = ["IdSource", "ReplayRequest", "SyntheticSpec", "load_mooncake", "synthetic_multitenant"]

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    tenant: str = "default"
    tier: str = "default"  # the tenant's tier (flow control's band, weight, longest wait)


def load_mooncake(
    path: str | Path, *, rate_scale: float = 1.0, limit: int | None = None,
    notes: list[str] | None = None,
) -> list[ReplayRequest]:
    """Read a Mooncake-format JSONL trace (`loadtest.replay.trace`; gzip too); `rate_scale` 1.5
    arrives 1.5x as fast; `limit`: the file's first N requests.

    Arrivals count from the earliest timestamp (a trace cut from the middle of a day, or in
    epoch milliseconds, starts at once: live replay waited for the timestamp) and the requests
    are sorted by arrival, equal ones in file order (an unsorted trace's pooled reference took
    them in file order while the replay took them in time order). `notes` receives what reads
    but looks wrong (`loadtest.replay.trace.notes`). `TraceError` for a file with no request."""
    rows = read_rows(path, limit)
    if not rows:
        raise TraceError("no request in it (an empty trace)")
    if notes is not None:
        notes += trace_notes(rows, MOONCAKE_BLOCK_TOKENS, rate_scale)
    t0 = min(r.timestamp for r in rows)
    out = [
        ReplayRequest(
            arrival_s=(r.timestamp - t0) / 1000.0 / rate_scale,
            prompt_tokens=r.input_length,
            output_tokens=max(1, r.output_length),  # vLLM's max_tokens is at least 1
            block_ids=r.hash_ids,
        )
        for r in rows
    ]
    out.sort(key=lambda r: r.arrival_s)  # stable: equal arrivals keep the file's order
    return out


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """A multi-tenant chat fleet: system prompts, growing conversations, shared RAG documents."""

    tenants: int = 8
    conversations_per_tenant: int = 12
    turns: int = 6
    system_prompt_tokens: int = 3072
    user_turn_tokens: int = 128
    answer_tokens: int = 192
    rag_documents: int = 24
    rag_document_tokens: int = 1536
    rag_probability: float = 0.5
    rate_per_s: float = 8.0
    bursty: bool = False
    block_tokens: int = 128
    seed: int = 7


def synthetic_multitenant(spec: SyntheticSpec | None = None) -> list[ReplayRequest]:
    """Requests of T tenants' conversations interleaved in time (Poisson or bursty arrivals).

    Each tenant has its own system prompt; each conversation's history grows turn by turn
    (the previous prompt + answer + a new user turn), and some conversations start with a
    document from a pool shared by all tenants. Block ids are unique per content piece.
    """
    s = spec or SyntheticSpec()
    rng = random.Random(s.seed)
    ids = IdSource()
    bt = s.block_tokens
    systems = [ids.take(s.system_prompt_tokens // bt) for _ in range(s.tenants)]
    docs = [ids.take(s.rag_document_tokens // bt) for _ in range(s.rag_documents)]
    convs: list[tuple[int, list[int]]] = []
    for t in range(s.tenants):
        for _ in range(s.conversations_per_tenant):
            prefix = list(systems[t])
            if rng.random() < s.rag_probability:
                prefix += docs[rng.randrange(len(docs))]
            convs.append((t, prefix))
    # one turn of one conversation at a time, conversations in a random order
    schedule = [(c, turn) for c in range(len(convs)) for turn in range(s.turns)]
    rng.shuffle(schedule)
    schedule.sort(key=lambda ct: ct[1])  # turn k of every conversation before turn k+1
    out: list[ReplayRequest] = []
    for now, (c, _turn) in zip(_arrivals(rng, s), schedule, strict=False):
        tenant, history = convs[c]
        history += ids.take(max(1, s.user_turn_tokens // bt))
        out.append(
            ReplayRequest(
                arrival_s=now,
                prompt_tokens=len(history) * bt,
                output_tokens=s.answer_tokens,
                block_ids=tuple(history),
                block_tokens=bt,
                tenant=f"tenant-{tenant}",
            )
        )
        history += ids.take(max(1, s.answer_tokens // bt))
    return out


class IdSource:
    """Fresh block ids: every `take` is content no other take shares."""

    def __init__(self) -> None:
        self._next = 1 << 40  # far from the Mooncake trace's ids

    def take(self, n: int) -> list[int]:
        first = self._next
        self._next += n
        return list(range(first, first + n))


def _arrivals(rng: random.Random, s: SyntheticSpec) -> Iterator[float]:
    now = 0.0
    while True:
        if s.bursty and rng.random() < 0.1:
            gap = 0.0  # a burst: several requests at the same instant
        else:
            gap = rng.expovariate(s.rate_per_s)
        now += gap
        yield now
