"""The draws every workload generator shares: text sizes, Zipf picks, requests of block ids.

A request's prompt is a list of block ids of `BLOCK` tokens (`loadtest.replay.workload`):
equal ids at equal positions are a shared prefix, a fresh `IdSource.take` is content no other
request shares.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from itertools import accumulate

from loadtest.replay.workload import ReplayRequest

__all__ = ["BLOCK", "blocks", "request", "tokens", "zipf"]

BLOCK = 64  # tokens per block id: fine enough that a question ends where it ends


def tokens(rng: random.Random, low: int, high: int) -> int:
    """Log-uniform in [low, high] (sizes of text spread over orders of magnitude)."""
    return int(math.exp(rng.uniform(math.log(low), math.log(high))))


def blocks(n_tokens: int) -> int:
    """Block ids covering ``n_tokens`` (at least one)."""
    return max(1, -(-n_tokens // BLOCK))


def zipf(rng: random.Random, n: int, a: float) -> Callable[[], int]:
    """Draws of 0..n-1, k with probability proportional to 1 / (k + 1)^a."""
    cum = list(accumulate(1.0 / (k + 1) ** a for k in range(n)))  # = choices(weights=...)
    population = list(range(n))
    return lambda: rng.choices(population, cum_weights=cum)[0]


def request(t: float, ids: list[int], out: int, tenant: str = "default") -> ReplayRequest:
    return ReplayRequest(t, len(ids) * BLOCK, out, tuple(ids), BLOCK, tenant)
