"""The paged KV cache with automatic prefix caching, counted in blocks.

Modelled on vLLM V1's block pool: one block is reserved (vLLM's null block), so a pool of
``num_gpu_blocks`` has ``num_gpu_blocks - 1`` usable blocks. A request holds *cached* blocks
(full prompt blocks registered under their chained hash, shared and ref-counted) and *private*
blocks (the partial tail, decode blocks, duplicates). A cached block nobody references stays in
memory and is evicted least-recently-freed first, only when an allocation finds no empty block.
Block contents are never modelled: a block is its hash or an anonymous count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KVCache"]


class KVCache:
    """Block accounting: empty blocks, referenced cached blocks and evictable cached blocks."""

    def __init__(self, num_gpu_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (one is reserved)")
        self.usable = num_gpu_blocks - 1
        self.enable_prefix_caching = enable_prefix_caching
        self.empty = self.usable  # blocks holding nothing
        self._ref: dict[int, int] = {}  # hash -> reference count (0 = evictable)
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable hashes, oldest first
        self.evictions = 0

    # -- queries ---------------------------------------------------------------------------
    def available(self) -> int:
        """Blocks an allocation could get: empty plus evictable."""
        return self.empty + len(self._lru)

    def used(self) -> int:
        """Blocks held by requests (what vLLM's kv_cache_usage_perc counts)."""
        return self.usable - self.empty - len(self._lru)

    def usage(self) -> float:
        return self.used() / self.usable

    def cached_blocks(self) -> int:
        return len(self._ref)

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._ref

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """Length of the longest run of leading ``hashes`` (at most ``limit``) that is cached."""
        if not self.enable_prefix_caching:
            return 0
        ref = self._ref
        n = 0
        for h in hashes[: max(limit, 0)]:
            if h not in ref:
                break
            n += 1
        return n

    def evictable_among(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (all cached) are unreferenced, i.e. counted as available."""
        lru = self._lru
        return sum(1 for h in hashes if h in lru)

    # -- mutations -------------------------------------------------------------------------
    def acquire(self, hashes: Sequence[int]) -> None:
        """Reference cached blocks (a prefix hit); unreferenced ones leave the eviction queue."""
        ref, lru = self._ref, self._lru
        for h in hashes:
            if ref[h] == 0:
                del lru[h]
            ref[h] += 1

    def allocate(self, n: int) -> bool:
        """Take ``n`` anonymous blocks; evict LRU cached blocks only when no empty one is left."""
        if n <= 0:
            return True
        if n > self.empty + len(self._lru):
            return False
        short = n - self.empty
        if short > 0:
            ref, lru = self._ref, self._lru
            for _ in range(short):
                h, _unused = lru.popitem(last=False)
                del ref[h]
            self.evictions += short
            self.empty += short
        self.empty -= n
        return True

    def register(self, block_hash: int) -> bool:
        """Turn one of the caller's private blocks into a cached block with one reference.

        Returns False (the block stays private) when caching is off or another request already
        registered the same hash, as vLLM keeps the first copy only.
        """
        if not self.enable_prefix_caching or block_hash in self._ref:
            return False
        self._ref[block_hash] = 1
        return True

    def discard(self) -> int:
        """Forget every cached block no request holds (vLLM's sleep discards the KV cache,
        ``/reset_prefix_cache`` the prefix cache); returns how many."""
        n = len(self._lru)
        for h in self._lru:
            del self._ref[h]
        self._lru.clear()
        self.empty += n
        return n

    def release(self, cached: Sequence[int], private: int) -> None:
        """Drop a request's blocks. Cached ones are queued tail-first so tails are evicted first."""
        ref, lru = self._ref, self._lru
        for h in reversed(cached):
            count = ref[h] - 1
            ref[h] = count
            if count == 0:
                lru[h] = None
        self.empty += private
