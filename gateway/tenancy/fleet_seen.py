"""The fleet a gateway's workers last saw, kept where a worker started again finds it.

While Redis is down each gateway process enforces its tenants' limits divided by the processes
it heard from in the minute before the outage (`fallback.FallbackRateLimiter.divisor`). A
worker that dies and is started again during the outage (`server.workers`) heard from none:
it divided by its own gateway's configured count (``gateway_replicas`` x ``server.workers``),
and in a fleet larger than configured it admitted more than its share, beside siblings that
divided by the fleet (measured: 3 processes, 3000 RPM: the siblings 1000, the restarted one
1500). So each worker writes the most processes it heard from lately to a file of its own in
the supervisor's directory (``fleet-seen-<slot>``), when that number changes, and a worker
that has heard nothing itself takes the largest number in those files: the siblings' and its
slot's predecessor's.

The number is no secret; the files go with the directory (`gateway.workers`). A file that
cannot be read or holds no number is skipped, so a worker never divides by less than its
configured count for want of one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

__all__ = ["FleetSeen"]

log = logging.getLogger(__name__)

PREFIX = "fleet-seen-"


class FleetSeen:
    """This worker's file of the fleet size it saw, beside its siblings'."""

    def __init__(self, directory: Path, slot: int) -> None:
        self.directory = directory
        self.path = directory / f"{PREFIX}{slot}"
        self._tmp = directory / f".{PREFIX}{slot}.{os.getpid()}.tmp"
        self._kept: int | None = None

    def keep(self, processes: int) -> None:
        """Note the most processes heard from lately. Written only when it changes (a fleet
        changes size rarely): a few bytes, so on the caller's thread."""
        if processes == self._kept:
            return
        try:
            self._tmp.write_text(str(processes))
            os.replace(self._tmp, self.path)  # a reader sees one number or the other
        except OSError as exc:
            log.warning("cannot keep the fleet size for restarted workers: %s",
                        exc.strerror or type(exc).__name__)
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            return
        self._kept = processes

    def recall(self) -> int | None:
        """The largest fleet a worker of this gateway saw, or None (no file readable)."""
        numbers = []
        for path in self.directory.glob(f"{PREFIX}*"):
            with contextlib.suppress(OSError, ValueError):  # replaced meanwhile, or garbage
                numbers.append(int(path.read_text()))
        return max((n for n in numbers if n > 0), default=None)
