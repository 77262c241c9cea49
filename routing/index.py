"""The affinity index: which prefix blocks each replica probably holds in its KV cache.

Per replica, an LRU of block hashes bounded by that replica's cache capacity (in our blocks),
mirroring vLLM's LRU of free cached blocks. A shared map from block hash to a bitmask of the
replicas holding it makes a match one walk down the request's chain, whatever the pool size:
at each depth the mask of replicas still matching shrinks, and a replica's match length is the
depth at which it drops out.

A request longer than the hashed prefix cap (``max_blocks``) still fills the replica's cache
with all its tokens: its tail block is charged the blocks beyond the cap (``tail_blocks``), so
the LRU's capacity is spent as the engine's is. Without this, long prompts would make the index
believe the cache holds far more than it does (on the Mooncake trace a third of all prompt
tokens lie beyond a 16k-token cap) and predict hits the engine has already evicted.

Blocks of a routed request are inserted tail first, so the request's first block is the most
recently used: like vLLM (which frees a request's blocks in reverse order), eviction eats
prefixes from their tail and a shared head survives longest. So the blocks of a chain a replica
holds are the chain's first ones, and `insert` refreshes them in one pass in C once it has
found the new ones at the tail.

Chains routed by other gateways (`routing.peers`) are inserted the same way with
``peer=True``; a block remembers whether a peer touched it last (the low bit of its stored
weight), which is how the router tells decisions that used peers' records.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["AffinityIndex"]


class _ReplicaLRU:
    __slots__ = ("blocks", "capacity", "slot", "used")

    def __init__(self, slot: int, capacity: int) -> None:
        self.slot = slot
        self.capacity = capacity
        # hash -> (capacity blocks it stands for) << 1 | (a peer touched it last)
        self.blocks: OrderedDict[int, int] = OrderedDict()
        self.used = 0


class AffinityIndex:
    """Bounded per-replica LRU of block hashes; answers longest-prefix matches for all replicas."""

    def __init__(self, default_capacity_blocks: int) -> None:
        self._default = max(1, default_capacity_blocks)
        self._replicas: dict[str, _ReplicaLRU] = {}
        self._by_slot: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._owners: dict[int, int] = {}  # block hash -> bitmask of replica slots

    # -- membership ---------------------------------------------------------------------------
    def _lru(self, replica: str) -> _ReplicaLRU:
        lru = self._replicas.get(replica)
        if lru is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._replicas)
            lru = self._replicas[replica] = _ReplicaLRU(slot, self._default)
            self._by_slot[slot] = replica
        return lru

    def set_capacity(self, replica: str, capacity_blocks: int) -> None:
        lru = self._lru(replica)
        lru.capacity = max(1, capacity_blocks)
        self._evict(lru)

    def capacity(self, replica: str) -> int:
        lru = self._replicas.get(replica)
        return lru.capacity if lru is not None else self._default

    def forget(self, replica: str) -> None:
        lru = self._replicas.pop(replica, None)
        if lru is None:
            return
        clear = ~(1 << lru.slot)
        owners = self._owners
        for h in lru.blocks:
            mask = owners[h] & clear
            if mask:
                owners[h] = mask
            else:
                del owners[h]
        del self._by_slot[lru.slot]
        self._free_slots.append(lru.slot)

    # -- updates ------------------------------------------------------------------------------
    def insert(
        self, replica: str, hashes: Sequence[int], tail_blocks: int = 0, peer: bool = False
    ) -> int:
        """``replica`` now holds the chain ``hashes`` (most recently used first block), plus
        ``tail_blocks`` more blocks of the same request beyond the hashed cap; ``peer``: the
        chain was routed by another gateway. Returns the blocks of it held before, as
        `match_one` would have counted them (a peer's route: what it brought, at no extra
        walk)."""
        if not hashes:
            return 0
        lru = self._replicas.get(replica)
        if lru is None:  # a new replica (a call less per insert: every chain of the fleet)
            lru = self._lru(replica)
        bit = 1 << lru.slot
        flag = 1 if peer else 0
        blocks, owners = lru.blocks, self._owners
        used = lru.used
        first = hashes[0]
        last_held = 0  # the capped chain's last block's weight before (its tail included)
        if tail_blocks > 0:
            h = hashes[-1]
            last_held = blocks.get(h, 0) >> 1
            used += 1 + tail_blocks - last_held
            if h not in blocks:
                owners[h] = owners.get(h, 0) | bit
            blocks[h] = ((1 + tail_blocks) << 1) | flag
            blocks.move_to_end(h)
            hashes = hashes[:-1]
        # Tail first: the blocks not held yet come first (a chain's held blocks are its head,
        # below), then the held ones are refreshed in one pass in C. Every process inserts
        # every chain of the fleet: this is most of what applying peers' records costs.
        fresh = 2 | flag
        own = owners.setdefault  # a new block is most often new to every replica: one lookup
        start = len(blocks)
        for h in reversed(hashes):
            if h in blocks:
                break
            blocks[h] = fresh
            mask = own(h, bit)
            if mask != bit:  # (never ``bit`` when held before: this replica did not hold it)
                owners[h] = mask | bit
        new = len(blocks) - start
        used += new
        before = len(hashes) - new  # a chain's held blocks are its head (above)
        if before:
            # the held blocks, newest last; moved in C, one lookup each (`_refresh_blockwise`)
            older = hashes[before - 1::-1]
            try:
                any(map(blocks.move_to_end, older))  # move_to_end returns None: all run
            except KeyError:
                used += self._refresh_blockwise(lru, older, fresh, bit)
            weight = blocks[first]  # (a new first block has the flag already)
            if weight & 1 != flag:
                blocks[first] = weight ^ 1
            if not new:  # all of it: its last block counts its tail, as in `match_one`
                before += last_held if tail_blocks > 0 else (blocks[hashes[-1]] >> 1) - 1
        elif tail_blocks > 0 and not hashes:  # the capped chain is its one (tail) block
            before = last_held
        lru.used = used
        if used > lru.capacity:
            self._evict(lru)
        return before

    def _refresh_blockwise(self, lru: _ReplicaLRU, older: Sequence[int], fresh: int,
                           bit: int) -> int:
        """Refresh ``older`` (a chain's blocks before its newest held one, newest last) block by
        block; the blocks added. `insert` moves them all in one pass instead, which holds
        because a chain's blocks are held as a prefix: every insert of a block also refreshes
        the blocks before it in its chain, later (a block's hash names its whole prefix), so a
        block is never older than the blocks after it and eviction takes a chain from its
        tail. An insert that breaks the rule (a hash collision, a hand-made chain) raises
        KeyError there and comes here: moving the blocks already moved once more, in the same
        order, leaves the same order."""
        blocks, owners = lru.blocks, self._owners
        move, held = blocks.move_to_end, owners.get
        added = 0
        for h in older:
            if h in blocks:
                move(h)
            else:
                blocks[h] = fresh
                owners[h] = held(h, 0) | bit
                added += 1
        return added

    def _evict(self, lru: _ReplicaLRU) -> None:
        blocks, owners = lru.blocks, self._owners
        bit = 1 << lru.slot
        used, capacity, oldest = lru.used, lru.capacity, blocks.popitem
        while used > capacity:
            h, weight = oldest(False)
            used -= weight >> 1
            mask = owners[h]
            if mask == bit:  # its only holder (most blocks): no mask computed
                del owners[h]
            else:
                owners[h] = mask ^ bit
        lru.used = used

    # -- queries ------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each replica holds (replicas matching nothing omitted:
        every count given is at least 1, which `cache_aware` relies on).

        When a replica holds the whole chain and its last block carries a tail weight (a
        prompt longer than the hash cap was routed there), the tail counts as held: the
        prompts the index cannot see past the cap are, on conversation traffic, the same
        history again. Without it a 70k-token conversation turn looks like 16k cached
        tokens everywhere, and the cost model gives its replica away for a shorter queue.
        """
        out: dict[str, int] = {}
        get = self._owners.get
        mask = -1
        depth = 0
        for h in hashes:
            held = get(h, 0) & mask
            if held != mask:  # some replica drops out here (most blocks: none, one test)
                dropped = mask & ~held if depth else 0
                while dropped:
                    low = dropped & -dropped
                    out[self._by_slot[low.bit_length() - 1]] = depth
                    dropped ^= low
                if not held:
                    return out
                mask = held
            depth += 1
        last = hashes[-1] if depth else 0
        while mask > 0:
            low = mask & -mask
            name = self._by_slot[low.bit_length() - 1]
            # the whole chain matched: a capped prompt's tail weight says how many blocks of
            # its request lay beyond the cap (a conversation's next turn shares them too)
            out[name] = depth - 1 + (self._replicas[name].blocks[last] >> 1)
            mask ^= low
        return out

    def match_one(self, replica: str, hashes: Iterable[int]) -> int:
        """Blocks of ``hashes`` ``replica`` holds (a fully matched capped chain counts its
        tail, as in `match`)."""
        lru = self._replicas.get(replica)
        if lru is None:
            return 0
        blocks = lru.blocks
        depth = 0
        last = 0
        for h in hashes:
            if h not in blocks:
                return depth
            depth += 1
            last = h
        return depth - 1 + (blocks[last] >> 1) if depth else 0

    def peer_touched(self, replica: str, block_hash: int) -> bool:
        """Whether ``replica``'s entry for ``block_hash`` was last refreshed by a peer."""
        lru = self._replicas.get(replica)
        return lru is not None and bool(lru.blocks.get(block_hash, 0) & 1)

    def holders(self, block_hash: int) -> int:
        """How many replicas hold ``block_hash``."""
        return self._owners.get(block_hash, 0).bit_count()

    def entries(self, replica: str) -> int:
        lru = self._replicas.get(replica)
        return len(lru.blocks) if lru is not None else 0

    def fills(self, replicas: Iterable[str]) -> tuple[list[float], list[int]]:
        """Per replica in order, its fill (`used` / `capacity`) and its capacity: a pick reads
        both for every candidate, one lookup each here instead of three method calls."""
        lrus, default = self._replicas, self._default
        fills: list[float] = []
        capacities: list[int] = []
        for replica in replicas:
            lru = lrus.get(replica)
            if lru is None:
                fills.append(0 / default)
                capacities.append(default)
            else:
                fills.append(lru.used / lru.capacity)
                capacities.append(lru.capacity)
        return fills, capacities

    def used(self, replica: str) -> int:
        """Capacity blocks ``replica``'s entries stand for (<= its capacity)."""
        lru = self._replicas.get(replica)
        return lru.used if lru is not None else 0

    def replicas(self) -> list[str]:
        return sorted(self._replicas)

    def distinct_blocks(self) -> int:
        return len(self._owners)
