"""Tiers and tenants on a replay workload, for flow control's benchmarks.

A Mooncake trace has neither: `assign` gives each conversation a tier drawn from a mix such
as ``premium:0.3,free:0.7`` and one of ``tenants`` tenants of that tier (``premium-0`` ...),
by a seeded hash, so a conversation keeps its tenant (and its cache salt) turn after turn.
A conversation is told by the first block of its own after the prefix it shares with others
(`conversation_keys`): in the Mooncake trace the second block (the first is the system prompt
every request shares), in an agent loop the first block after its tool prompt, however long.
`noisy` makes one tenant send ``factor`` times its share: ``factor - 1`` extra copies of each
of its requests (fresh block ids after the shared system prompt, each within a second of the
original: a bursty tenant), added on top of the workload, so the other tenants' traffic is
exactly the same with and without it.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from loadtest.cmdline import positive
from loadtest.replay.workload import ReplayRequest

__all__ = ["add_args", "assign", "conversation_keys", "noisy", "parse_mix", "shape"]

NOISY_BLOCKS = 1 << 50  # block ids of the noisy tenant's extra requests start here


def parse_mix(text: str) -> list[tuple[str, float]]:
    """``premium:0.3,free:0.7`` -> [("premium", 0.3), ("free", 0.7)] (normalized)."""
    pairs = []
    for part in text.split(","):
        name, _, share = part.partition(":")
        try:
            value = float(share)
        except ValueError:
            raise ValueError(f"--tier-mix: {part!r} is not TIER:SHARE") from None
        if not name or not 0 < value < math.inf:  # (nan passed a `<= 0` test)
            raise ValueError(f"--tier-mix: {part!r} is not TIER:SHARE with SHARE > 0")
        pairs.append((name, value))
    total = sum(v for _, v in pairs)
    return [(n, v / total) for n, v in pairs]


def _unit(key: str, salt: str) -> float:
    digest = hashlib.blake2b(f"{salt}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def conversation_keys(reqs: Sequence[ReplayRequest]) -> list[str]:
    """Per request, the block that starts its conversation: the one after the first block of
    its chain that several chains continue differently (a shared prompt ends there; a
    conversation's turns extend one chain, so its own blocks have one successor each). A chain
    that never branches (a one-off prompt) is a conversation of one request."""
    successors: dict[tuple[int, int], set[int]] = defaultdict(set)
    for r in reqs:
        b = r.block_ids
        for i in range(len(b) - 1):
            successors[(i, b[i])].add(b[i + 1])
    keys = []
    for n, r in enumerate(reqs):
        b = r.block_ids
        at = next((i for i in range(len(b) - 1) if len(successors[(i, b[i])]) > 1), None)
        keys.append(f"#{n}" if at is None else str(b[at + 1]))
    return keys


def assign(
    reqs: Sequence[ReplayRequest], mix: Sequence[tuple[str, float]], tenants: int,
    seed: int = 0,
) -> list[ReplayRequest]:
    out = []
    for r, key in zip(reqs, conversation_keys(reqs), strict=True):
        u, acc, tier = _unit(key, f"tier{seed}"), 0.0, mix[-1][0]
        for name, share in mix:
            acc += share
            if u < acc:
                tier = name
                break
        k = int(_unit(key, f"tenant{seed}") * tenants)
        out.append(replace(r, tier=tier, tenant=f"{tier}-{k}"))
    return out


def noisy(
    reqs: Sequence[ReplayRequest], tenant: str, factor: float, seed: int = 0
) -> list[ReplayRequest]:
    """``reqs`` plus ``factor - 1`` copies of each of ``tenant``'s requests, sorted."""
    rng = random.Random(seed)
    extra = []
    next_id = NOISY_BLOCKS
    own = [r for r in reqs if r.tenant == tenant]
    copies = factor - 1.0
    for r in own:
        n = int(copies) + (1 if rng.random() < copies - int(copies) else 0)
        for _ in range(n):
            fresh = tuple(range(next_id, next_id + len(r.block_ids) - 1))
            next_id += len(fresh)
            extra.append(replace(r, arrival_s=r.arrival_s + rng.random(),
                                 block_ids=r.block_ids[:1] + fresh))
    return sorted([*reqs, *extra], key=lambda r: r.arrival_s)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tiers, tenants and flow control (offline)")
    g.add_argument("--tier-mix", metavar="T:S,...",
                   help="give the workload tiers, e.g. premium:0.3,free:0.7 (by conversation)")
    g.add_argument("--tenants", type=positive(int), default=4, metavar="N",
                   help="tenants per tier with --tier-mix (default 4)")
    g.add_argument("--noisy-tenant", metavar="TENANT[:FACTOR]",
                   help="one tenant sends FACTOR (default 5) times its share, e.g. free-0:5")
    g.add_argument("--flow-control", choices=["on", "off"], default="off",
                   help="the gateway's admission queue in front of the routers (default off)")
    g.add_argument("--flow-max-inflight", type=positive(int), default=None, metavar="N",
                   help="with --flow-control on: a replica is full at N requests in flight "
                        "(the gateway's flow.max_inflight; default: no such bound)")
    g.add_argument("--slo-ttft-s", type=positive(float), default=2.0,
                   help="TTFT SLO of the per-tier and per-tenant goodput (default 2)")


def shape(args: argparse.Namespace, reqs: list[ReplayRequest]) -> list[ReplayRequest]:
    """The workload with the tiers, tenants and noisy tenant the flags ask for."""
    if args.tier_mix:
        reqs = assign(reqs, parse_mix(args.tier_mix), max(1, args.tenants))
    if args.noisy_tenant:
        name, _, factor = args.noisy_tenant.partition(":")
        try:
            times = float(factor) if factor else 5.0
        except ValueError:
            raise ValueError(f"--noisy-tenant: {factor!r} is not a number") from None
        if times < 1:
            raise ValueError("--noisy-tenant: FACTOR must be >= 1")
        if not any(r.tenant == name for r in reqs):
            raise ValueError(f"--noisy-tenant: no request of tenant {name!r} in the workload")
        reqs = noisy(reqs, name, times)
    return reqs
