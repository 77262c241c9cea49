"""Spill problems judged for a rolling upgrade and against the policy in force.

`check_spills` follows every spill edge; the release before it kept only the first tier's
edge per pool (and model), so some cycles passed (two tiers spilling one pool to different
pools). A config file such a release started with must still start: what that check
refused stays refused, a problem only the full check finds is a warning at start
(`start_spill_warnings`). The admin API refuses a write that adds a spill problem, and
accepts one that only keeps a problem the policy in force already has (`spill_problems`).
"""

from __future__ import annotations

from itertools import pairwise

from gateway.policy_doc import PolicyDoc, PolicyValidationError

__all__ = ["check_spills_at_start", "refused_before", "spill_problems", "start_spill_warnings"]

HOW_SPILL_RUNS = ("a request spills at most once (one hop, to its tier's spill_to), so no "
                  "request loops, but the tiers on the cycle take each other's pool whenever "
                  "their own is busy")


def spill_problems(doc: PolicyDoc) -> list[tuple[str, str]]:
    """Every spill problem of `doc` as (field, message): each model's spill cycles (one per
    pool it starts from, deduplicated), each `spill_to` that would never spill."""
    out: dict[tuple[str, str], None] = {}
    for model in doc.models:
        edges: dict[str, dict[str, str]] = {}
        for tier_name, tier in doc.tiers.items():
            src = doc.pool_for(model, tier_name)
            if src is not None and tier.spill_to is not None and src != tier.spill_to:
                edges.setdefault(src, {}).setdefault(tier.spill_to, tier_name)
        for cycle in _cycles(edges):
            tiers = [edges[a][b] for a, b in pairwise(cycle)]
            out[(f"tiers.{tiers[-1]}.spill_to",
                 f"spill cycle for model {model!r}: {' -> '.join(cycle)} (tiers "
                 f"{', '.join(dict.fromkeys(tiers))})")] = None
    for tier_name, tier in doc.tiers.items():
        served = {m: p for m in doc.models if (p := doc.pool_for(m, tier_name)) is not None}
        if tier.spill_to is not None and served and set(served.values()) == {tier.spill_to}:
            out[(f"tiers.{tier_name}.spill_to",
                 f"{tier.spill_to!r} is the tier's own pool for every model it serves "
                 f"({', '.join(map(repr, sorted(served)))}): it would never spill")] = None
    return list(out)


def _cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """The simple cycles of a small spill graph, each once, as first found depth first
    (the first as `check_spills` reports it)."""
    found: dict[tuple[str, ...], list[str]] = {}  # rotated to its least pool -> as found

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            ring = path[path.index(node):]
            i = ring.index(min(ring))
            found.setdefault(tuple(ring[i:] + ring[:i]), ring)
            return
        for nxt in edges.get(node, {}):
            visit(nxt, [*path, node])

    for start in edges:
        visit(start, [])
    return [[*ring, ring[0]] for ring in found.values()]


def refused_before(doc: PolicyDoc) -> bool:
    """Whether the previous release's spill check refused `doc`: one edge per pool and model
    (the first tier's, in the tiers' order), and a tier whose spill_to is its own pool for
    the models it serves, none spilling elsewhere."""
    own_only: set[str] = set()
    elsewhere: set[str] = set()
    for model in doc.models:
        edges: dict[str, str] = {}
        for tier_name, tier in doc.tiers.items():
            src, dst = doc.pool_for(model, tier_name), tier.spill_to
            if src is None or dst is None:
                continue
            if src == dst:
                own_only.add(tier_name)
                continue
            elsewhere.add(tier_name)
            edges.setdefault(src, dst)
        for start in edges:
            seen, node = [start], start
            while node in edges:
                node = edges[node]
                if node in seen:
                    return True
                seen.append(node)
    return bool(own_only - elsewhere)


def start_spill_warnings(doc: PolicyDoc) -> list[str]:
    """One warning line per spill problem of a config file the previous release started
    with (`refused_before` is false, so start is not refused for it)."""
    problems = spill_problems(doc)
    if not problems:
        return []
    return [f"{field}: {message}: accepted by the previous release, so kvgate still starts; "
            f"{HOW_SPILL_RUNS}. Fix it in the file; the admin API refuses a write that adds "
            "such a problem" for field, message in problems]


def check_spills_at_start(doc: PolicyDoc) -> None:
    """`check_spills` for a config file: refuses only what the previous release refused."""
    if refused_before(doc):
        from gateway.policy_doc import check_spills

        check_spills(doc)  # raises, naming the problem as the admin API does
        field, message = spill_problems(doc)[0]
        raise PolicyValidationError(field, message)
