"""Which requests continue a context, and how many live contexts each replica carries.

A context (an agent session, a conversation) comes back as a request whose prompt extends the
previous request's whole prompt, so its chain of block hashes passes through that request's
last hash (its tail). A request whose longest match anywhere ends on no earlier tail shares
only a prefix with earlier requests (a tool or system prompt, a document): it opens a new
context. A context that came back within ``window_s`` is live on the replica its last request
went to; a live context will send more requests there (an agent's next call follows in
seconds), which the load bound sees only when they arrive.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

__all__ = ["Sessions"]

# quick returns in a row that make a context live: one can be chance (the same conversation
# drawn twice in a burst), two in a row is an agent's loop
_STREAK = 2
_EXPIRE_EVERY_S = 1.0  # peers' routes expire quiet contexts at most this often (`peer_routed`)
_SCAN = 64  # a peer's chain's last blocks searched for the tail it continued
_OUTCOMES = 256  # live contexts' latest outcomes `Sessions.returning` averages


class Sessions:
    """Tails of recent requests (at most ``capacity``, oldest forgotten first) and the live
    contexts per replica. Not thread-safe; owned by one policy instance, like the index."""

    def __init__(self, window_s: float, capacity: int = 65_536) -> None:
        if window_s <= 0 or capacity <= 0:
            raise ValueError("Sessions: window_s and capacity must be positive")
        self._window = window_s
        self._capacity = capacity
        # tail -> (time of its request, quick returns in a row of its context up to it)
        self._tails: OrderedDict[int, tuple[float, int]] = OrderedDict()
        # a live context's latest tail -> (time of its last request, replica); oldest first
        self._live: OrderedDict[int, tuple[float, str]] = OrderedDict()
        self._count: dict[str, int] = {}
        self._expired_at = float("-inf")  # when `live` last expired quiet contexts
        # of the live contexts' last `_OUTCOMES` outcomes (came back within the window, or
        # went quiet), the share that came back; 1 until one is seen
        self._returning = 1.0
        self._outcomes = 0

    def continued(self, hashes: Sequence[int], matched_blocks: int) -> int | None:
        """The tail this request continues (its chain's block ``matched_blocks - 1``, the end of
        its longest match, when an earlier request ended there), else None: a new context."""
        if 0 < matched_blocks <= len(hashes):
            tail = hashes[matched_blocks - 1]
            if tail in self._tails:
                return tail
        return None

    def peer_routed(self, replica: str, hashes: Sequence[int], now: float) -> None:
        """Another gateway sent the request with this chain to ``replica``: recorded as if
        ours, continuing the deepest earlier tail on its chain (its longest match is not
        known here; a context grows by a few blocks a call, so only the chain's last
        ``_SCAN`` blocks are searched). With no pick of ours to expire them, contexts
        gone quiet are expired here too (at most every ``_EXPIRE_EVERY_S``)."""
        tails = self._tails
        previous = None
        # a loop, not `filter(tails.__contains__, ...)` over a slice: the previous tail is
        # most often a few blocks from the end, where 3.11's loop is cheaper than building
        # the slice and the iterators (5 % dearer over a whole chain with no tail on it)
        for h in reversed(hashes) if len(hashes) <= _SCAN else reversed(hashes[-_SCAN:]):
            if h in tails:
                previous = h
                break
        self.record(hashes, replica, now, previous)
        if now - self._expired_at >= _EXPIRE_EVERY_S:
            self.live(now)

    def live(self, now: float) -> Mapping[str, int]:
        """Live contexts per replica (replicas with none are absent)."""
        self._expired_at = now
        horizon = now - self._window
        live, count = self._live, self._count
        while live:
            tail, (t, replica) = next(iter(live.items()))
            if t >= horizon:
                break
            del live[tail]
            self._drop(replica)
            self._outcome(0.0)
        return count

    @property
    def returning(self) -> float:
        """The share of live contexts that came back within the window (of the last
        `_OUTCOMES` that came back or went quiet; 1 before the first)."""
        return self._returning

    def _outcome(self, came_back: float) -> None:
        self._outcomes = n = min(self._outcomes + 1, _OUTCOMES)
        self._returning += (came_back - self._returning) / n

    def routed(self, replica: str, hashes: Sequence[int]) -> None:
        """The request with this chain was sent to ``replica`` (`Router.record_route`): when
        its context was counted live on another replica (the pick's choice, then a retry on a
        fallback), it is counted on ``replica`` now."""
        tail = hashes[-1]
        entry = self._live.get(tail)
        if entry is not None and entry[1] != replica:
            self._live[tail] = (entry[0], replica)
            self._drop(entry[1])
            self._count[replica] = self._count.get(replica, 0) + 1

    def record(self, hashes: Sequence[int], replica: str, now: float, previous: int | None) -> None:
        """The request with this chain went to ``replica``; ``previous``: the tail it continued."""
        if not hashes:
            return
        tail = hashes[-1]
        tails = self._tails
        streak = 0
        quick = False
        if previous is not None:
            seen = tails.get(previous)
            quick = seen is None or now - seen[0] <= self._window
            if quick:
                streak = seen[1] + 1 if seen is not None else 1
        if tail in tails:  # the same prompt once more: now the newest
            tails.move_to_end(tail)
        tails[tail] = (now, streak)
        if len(tails) > self._capacity:
            tails.popitem(last=False)
        if previous is None:
            return
        old = self._live.pop(previous, None)
        if old is not None:
            self._drop(old[1])
            self._outcome(1.0 if quick else 0.0)
        if streak < _STREAK:  # came back slowly or once: no stream of calls (yet)
            return
        again = self._live.pop(tail, None)  # the same prompt once more
        if again is not None:
            self._drop(again[1])
        self._live[tail] = (now, replica)
        self._count[replica] = self._count.get(replica, 0) + 1

    def _drop(self, replica: str) -> None:
        n = self._count[replica] - 1
        if n:
            self._count[replica] = n
        else:
            del self._count[replica]
