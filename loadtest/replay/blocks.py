"""Chained hashes of fixed-size token units, built from a request's block ids (no text).

Offline replay needs the hashes the simulator's engine would compute (16-token KV blocks) and
the hashes the router would compute (its `block_chars` blocks) without rendering and hashing
megabytes of text. A unit's hash chains its parent's and names the block id(s) it covers and
its offset, so two requests share exactly as many leading unit hashes as they share leading
tokens under the trace's semantics, which is what the text-based hashes give in live replay.
"""

from __future__ import annotations

import struct

from xxhash import xxh3_64_intdigest

__all__ = ["unit_hashes"]

_PACK = struct.Struct("<qqI").pack


def unit_hashes(
    block_ids: tuple[int, ...], block_tokens: int, unit_tokens: int, n_units: int, seed: int
) -> tuple[int, ...]:
    """Hashes of the first `n_units` units of `unit_tokens` tokens each."""
    out: list[int] = []
    h = seed
    for u in range(n_units):
        start = u * unit_tokens
        first = start // block_tokens
        last = (start + unit_tokens - 1) // block_tokens
        if last >= len(block_ids):
            break
        # the ids a unit spans (one, unless units are larger than blocks) and where it starts
        span = block_ids[first] if first == last else hash(block_ids[first : last + 1])
        h = xxh3_64_intdigest(_PACK(span, h & 0x7FFFFFFFFFFFFFFF, start % block_tokens), seed)
        out.append(h)
    return tuple(out)
