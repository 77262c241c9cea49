"""How many entries the routes stream keeps: at most ``stream_maxlen``, and fewer when entries
are large, so the stream stays within ``stream_max_mb`` of Redis's memory at any request rate.

An entry holds one gateway's routes of one flush interval, so its size grows with the request
rate: capped by entries alone the stream held ~270 MB at 2,000 requests/s over two gateways
(20,000 entries of ~13 KB). Each publisher follows the size of its own recent entries and
trims (``XADD ... MAXLEN ~ n``) to what the budget holds at that size. Redis keeps an entry in
about `OVERHEAD` x its field bytes + `PER_ENTRY` (measured with ``MEMORY USAGE``: 1.14x for
entries of 50 routes, 1.26x for 5, 70 B for an empty heartbeat of 48), an upper bound here, so
the stream stays under the budget rather than over it. The trim is Redis's approximate one
(whole listpack nodes, O(1) amortised): a few entries over at most.

Redis's XADD takes one trim rule, and age needs none: the stream only serves the catch-up of a
starting gateway (its last ``catchup_entries``) and readers cut off for a moment, and history
of any age is what a gateway that never restarted holds in its own index anyway (an LRU sized
from each replica's cache, which forgets old prefixes the same way).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MIN_ENTRIES", "OVERHEAD", "PER_ENTRY", "StreamBudget"]

OVERHEAD = 1.3  # Redis's bytes per byte of an entry's fields (measured 1.14-1.26)
PER_ENTRY = 32  # and per entry (ids, listpack headers)
MIN_ENTRIES = 100  # never fewer (a backlog of a few intervals, whatever the entries' size)
_WEIGHT = 1 / 32  # of a smaller entry: ~a second of batches under load


class StreamBudget:
    """The ``MAXLEN`` of each XADD, from this publisher's recent entry sizes."""

    def __init__(self, maxlen: int, max_bytes: int) -> None:
        self.maxlen = maxlen
        self.max_bytes = max_bytes
        self._size = 0.0  # bytes of this publisher's entries' fields, recent (see below)

    def trim_to(self, fields: Mapping[bytes, bytes]) -> int:
        """Note an entry about to be written; the number of entries the stream may keep."""
        size = sum(map(len, fields)) + sum(map(len, fields.values()))
        # a larger entry counts at once (a burst's entries must not overrun the budget while
        # a mean catches up), smaller ones bring it down over a few dozen entries
        recent = self._size
        self._size = recent = size if size > recent else recent + (size - recent) * _WEIGHT
        held = int(self.max_bytes / (OVERHEAD * recent + PER_ENTRY))
        return max(MIN_ENTRIES, min(self.maxlen, held))
