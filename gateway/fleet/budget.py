"""How many entries the routes stream keeps: at most ``stream_maxlen``, and fewer when entries
are large, so the stream stays within ``stream_max_mb`` of Redis's memory at any request rate.

An entry holds one gateway's routes of one flush interval, so its size grows with the request
rate: capped by entries alone the stream held ~270 MB at 2,000 requests/s over two gateways
(20,000 entries of ~13 KB). Each publisher trims (``XADD ... MAXLEN ~ n``) to the number of
entries its own most recent ones fill the budget with: the stream's last n entries are the
gateways' latest, which look like its own when the gateways share the load. Redis keeps an
entry in about `OVERHEAD` x its field bytes + `PER_ENTRY` (measured with ``MEMORY USAGE``:
1.14x for entries of 50 routes, 1.26x for 5, 70 B for an empty heartbeat of 48; 1.19-1.22x
at 2,000 routed requests/s), an upper bound here. Until its own entries fill the budget
(a gateway just started) the ones not seen yet are taken to be of their mean size. The trim
is Redis's approximate one (whole listpack nodes, O(1) amortised): a few entries over at most.

The window matters: batch sizes swing from one interval to the next and with the load, and a
cap from the last few dozen entries (a moving mean, or their peak) was off whenever those
differed from the thousands the stream holds (measured at 2,000 requests/s against a 4 MiB
budget: the peak kept 1.9-2.1 MiB, a mean of the last 32 let it reach 4.66 MiB).

Redis's XADD takes one trim rule, and age needs none: the stream only serves the catch-up of a
starting gateway (its last ``catchup_entries``) and readers cut off for a moment, and history
of any age is what a gateway that never restarted holds in its own index anyway (an LRU sized
from each replica's cache, which forgets old prefixes the same way).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Mapping

__all__ = ["MIN_ENTRIES", "OVERHEAD", "PER_ENTRY", "StreamBudget"]

OVERHEAD = 1.3  # Redis's bytes per byte of an entry's fields (measured 1.14-1.26)
PER_ENTRY = 32  # and per entry (ids, listpack headers)
MIN_ENTRIES = 100  # never fewer (a backlog of a few intervals, whatever the entries' size)


class StreamBudget:
    """The ``MAXLEN`` of each XADD, from this publisher's recent entry sizes."""

    def __init__(self, maxlen: int, max_bytes: int) -> None:
        self.maxlen = maxlen
        self.max_bytes = max_bytes
        # Redis bytes of this publisher's entries, cumulated, oldest first after a base (the
        # total of the ones let go); 8 bytes an entry, at most 2 x maxlen of them
        self._total = array("d", [0.0])

    def trim_to(self, fields: Mapping[bytes, bytes]) -> int:
        """Note an entry about to be written; the number of entries the stream may keep."""
        size = sum(map(len, fields)) + sum(map(len, fields.values()))
        total = self._total
        total.append(total[-1] + OVERHEAD * size + PER_ENTRY)
        first = bisect_left(total, total[-1] - self.max_bytes)  # the oldest that still fits
        if first == 0:  # all of ours fit: the rest taken to be like them, on average
            seen = len(total) - 1
            held = int(self.max_bytes * seen / (total[-1] - total[0]))
        else:  # the entries after `first`: with it they would not fit
            held = len(total) - 1 - first
        if len(total) > 2 * self.maxlen:  # the oldest are past any cap: let them go
            del total[:len(total) - self.maxlen - 1]
        return max(MIN_ENTRIES, min(self.maxlen, held))
