"""Closed-form planning of many decode-only engine steps at once.

While every running request is decoding and nothing arrives, each step decodes one token per
request and its time grows linearly (each step reads one more KV token per sequence), so the
start of step j is ``j*base + growth*j*(j-1)/2`` after the first. The plan stops before:
the first finish (handled by a normal step), the horizon (no step may start at or after it) and
the point where the blocks the decodes need would exceed the free+evictable blocks (a normal
step then preempts exactly as vLLM would).
"""

from __future__ import annotations

from collections.abc import Sequence

from loadtest.sim.costmodel import CostModel

__all__ = ["plan_fast_forward"]

MIN_STEPS = 2  # below this, a normal step is as cheap


def plan_fast_forward(
    seqs: Sequence[tuple[int, int, int]],
    available_blocks: int,
    block_size: int,
    cost: CostModel,
    now: float,
    until: float,
) -> tuple[int, float, int] | None:
    """``seqs`` = (computed tokens, tokens left to generate, blocks held) per running request.

    Returns (steps k, their total duration, blocks to allocate) or None when not worth it.
    """
    if not seqs:
        return None
    kmax = min(left for _, left, _ in seqs) - 1
    if kmax < MIN_STEPS:
        return None
    n = len(seqs)
    context0 = sum(c + 1 for c, _, _ in seqs)
    base = cost.step_time(0, n, context0)
    growth = cost.kv_read_token_s * n

    def start_of(j: int) -> float:
        return j * base + growth * j * (j - 1) / 2

    def blocks_for(k: int) -> int:
        return sum(max(0, -(-(c + k) // block_size) - held) for c, _, held in seqs)

    horizon = until - now
    lo, hi = 0, kmax  # largest k with start_of(k - 1) < horizon and blocks_for(k) <= available
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if start_of(mid - 1) < horizon and blocks_for(mid) <= available_blocks:
            lo = mid
        else:
            hi = mid - 1
    if lo < MIN_STEPS:
        return None
    return lo, start_of(lo), blocks_for(lo)
