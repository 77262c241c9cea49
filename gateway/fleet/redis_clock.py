"""Redis's clock as seen from this process, for the apply lag of shared routing records.

The lag of a record is how long after its publication a gateway applied it. The writer's wall
clock (the record's ``t``) against the reader's is only right when the two hosts' clocks
agree: a peer whose clock is a second behind made every lag look a second longer, one ahead
made them 0. Both ends of the measure are taken on one clock instead, Redis's: a stream
entry's id is Redis's time (ms) when it was written, and this process knows Redis's time from
its own writes -- each XADD's reply is the id Redis gave it, stamped between the moment the
command left and the moment its reply came back. The offset between Redis's clock and our
monotonic clock is the middle of that interval; of the last `WINDOW` writes the one with the
shortest round trip bounds it best (as NTP picks its samples), within half that round trip
(~0.1 ms on a LAN) plus the id's 1-ms resolution. No host clock needs to agree with another,
and a wall-clock step here changes nothing (the monotonic clock does not step).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

__all__ = ["WINDOW", "RedisClock"]

WINDOW = 32  # writes: under load under a second of them, idle 16 s (one heartbeat a 0.5 s)
_HALF_MS = 0.0005  # an id's milliseconds are truncated: the write happened within that ms


class RedisClock:
    """Maps this process's monotonic clock onto Redis's, learned from its own writes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (rtt, offset)
        self._offset: float | None = None

    def sample(self, sent: float, received: float, entry_id: object) -> None:
        """An XADD sent at ``sent`` and answered with ``entry_id`` at ``received`` (this
        clock). A reply that is not an id (an error) teaches nothing."""
        if not isinstance(entry_id, bytes):
            return
        ms, _, _ = entry_id.partition(b"-")
        if not ms.isdigit():
            return
        rtt = max(0.0, received - sent)
        self._samples.append((rtt, int(ms) / 1000.0 + _HALF_MS - (sent + received) / 2))
        self._offset = min(self._samples)[1]

    def forget(self) -> None:
        """Redis's clock changed under us (a fresh server whose ids are behind the old
        one's): the samples of the old one would keep its offset until all `WINDOW` left,
        every lag meanwhile off by the difference (ten minutes read as ten minutes late)."""
        self._samples.clear()
        self._offset = None

    def now_ms(self) -> float | None:
        """Redis's time now (ms, as in an entry's id); None before the first write of ours
        taught the offset."""
        if self._offset is None:
            return None
        return (self.clock() + self._offset - _HALF_MS) * 1000.0

    def lag(self, written_ms: int) -> float | None:
        """Seconds since Redis wrote the entry of id ``written_ms``-*, by Redis's clock; None
        before the first write of ours taught the offset. Never negative (the offset is
        known within half a round trip)."""
        now = self.now_ms()
        return None if now is None else max(0.0, (now - written_ms) / 1000.0)
