"""Spill problems judged for a rolling upgrade and against the policy in force.

`check_spills` follows every spill edge; the release before it kept only the first tier's
edge per pool (and model), so some cycles passed (two tiers spilling one pool to different
pools). A config file such a release started with must still start: what that check
refused stays refused, a problem only the full check finds is a warning at start
(`start_spill_warnings`). The admin API refuses a write that adds a spill problem, and
accepts one that only keeps a problem the policy in force already has
(`gateway.policy_doc.spill_problems`).
"""

from __future__ import annotations

from gateway.policy_doc import PolicyDoc, check_spills, spill_problems

__all__ = ["check_spills_at_start", "refused_before", "start_spill_warnings"]

HOW_SPILL_RUNS = ("a request spills at most once (one hop, to its tier's spill_to), so no "
                  "request loops, but the tiers on the cycle take each other's pool whenever "
                  "their own is busy")


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
    if refused_before(doc):  # (a subset of what `check_spills` refuses: it raises)
        check_spills(doc)
