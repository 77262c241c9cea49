"""The pooled reference hit rate: one LRU cache holding the whole fleet's KV memory.

A reference, not a bound: a single cache as large as all replicas together has no duplicate
and no misrouted request, but LRU is not the best a cache can do, so routing may pass it --
separate replicas keep one group's blocks from evicting another's (a partition LRU lacks), and
a request queued at a replica is admitted, and its hit counted, once the requests before it
cached their blocks (here each request is served in arrival order at once). Seen on the
shipped Mooncake sample at 1.5x rate: sglang_style's rule, which piles requests on holders,
0.071 against this reference's 0.056, with TTFT p99 4.5x cache_aware's.

Requests are taken in arrival order; a request hits the longest run of its leading full cache
blocks present in the cache, then all its full blocks are inserted (most recently used). Blocks
are the engine's `cache_block_tokens`; a trace block of `block_tokens` covers `block_tokens //
cache_block_tokens` of them, which are always used together, so the LRU keeps one entry per
trace block with the count of cache blocks of it that are cached (a partial last block caches
fewer). An entry is a block *with the prefix before it*, as an engine's block hash chains its
parent's: keyed by the id alone, a document read after two different system prompts was one
entry, and its second reading a hit no engine would see (the hot-prefixes workload's reference
0.68 for a chained LRU's 0.52).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from loadtest.replay.workload import ReplayRequest

__all__ = ["pooled_reference_hit_rate"]


def pooled_reference_hit_rate(
    requests: Iterable[ReplayRequest], capacity_tokens: int, cache_block_tokens: int = 16,
    max_model_len: int | None = None,
) -> float:
    """Hit tokens / prompt tokens over `requests` with one LRU of `capacity_tokens`.

    With `max_model_len`, a request the replicas refuse (prompt + output over it) is left out,
    as the replicas' own hit rate leaves it out: one 200k-token prompt refused by every replica
    took the reference from 0.33 to 0.005 beside a replay's hit rate of 0.33."""
    lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # (salt, chain) -> blocks held
    capacity = capacity_tokens // cache_block_tokens
    used = 0
    hits = total = 0
    for r in requests:
        if max_model_len is not None and r.prompt_tokens + r.output_tokens > max_model_len:
            continue
        per = r.block_tokens // cache_block_tokens
        full = r.prompt_tokens // cache_block_tokens
        total += r.prompt_tokens
        matching = True
        chain = 0
        for j, bid in enumerate(r.block_ids):
            need = min(per, full - j * per)
            if need <= 0:
                break
            chain = hash((chain, bid))  # the prefix up to this block (ints: no hash seed)
            key = (r.tenant, chain)
            held = lru.get(key, 0)
            if matching:
                got = min(held, need)
                hits += got * cache_block_tokens
                matching = got == need
            if held < need:
                used += need - held
                lru[key] = need
            lru.move_to_end(key)
            while used > capacity and lru:
                _, dropped = lru.popitem(last=False)
                used -= dropped
    return hits / total if total else 0.0
