"""Who holds a concurrency lease, so a process that dies frees its tenants' concurrency soon.

Every process admitting on Redis (`redis_limits.RedisRateLimiter`) is a lease holder with a
random id; its lease ids start with it (``<holder>.<random>``) and, while it holds any, it
keeps a heartbeat key ``<ns>:lease-holder:<holder>`` alive (`HOLDER_TTL_S` by default,
written every third of it and by each of its admissions, in the admission's own script).
Each tenant's lease holders are a set beside its leases (``...:holders``, written by the
admission that takes a lease, kept alive by the renewal). An admission that finds its tenant
full drops, in the same script, the holders whose heartbeat is gone and their leases: a dead
process's leases stop counting within the heartbeat's TTL instead of the lease TTL (30 s).
No round trip is added to the request path; the heartbeat is one ``SET`` a process per
interval, whatever the number of its leases (measured: ~2-6 µs of Redis, where renewing
1,024 leases costs ~10 ms).

A worker of ``server.workers`` > 1 writes its holder id to a file of its slot in the
supervisor's directory (``lease-holder-<slot>``), and the supervisor, which sees a worker die,
deletes that holder's heartbeat at once (`forget_holder`): the tenant's next admission frees
the dead worker's leases.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

__all__ = ["HOLDER_TTL_S", "HolderFile", "forget_holder", "holder_key"]

log = logging.getLogger(__name__)

HOLDER_TTL_S = 5.0
PREFIX = "lease-holder-"


def holder_key(namespace: str, holder: str) -> str:
    """The heartbeat key of a lease holder (a process)."""
    return f"{namespace}:lease-holder:{holder}"


class HolderFile:
    """A worker's lease holder id, where the supervisor finds it when the worker dies."""

    def __init__(self, directory: Path, slot: int) -> None:
        self.path = directory / f"{PREFIX}{slot}"
        self._tmp = directory / f".{PREFIX}{slot}.{os.getpid()}.tmp"

    def write(self, holder: str) -> None:
        """Once, before the worker serves (a few bytes, on the caller's thread)."""
        try:
            self._tmp.write_text(holder)
            os.replace(self._tmp, self.path)
        except OSError as exc:  # its leases then outlive it by the heartbeat's TTL
            log.warning("cannot note this worker's lease holder for its supervisor: %s",
                        exc.strerror or type(exc).__name__)
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)

    def take(self) -> str | None:
        """The holder id a dead worker wrote (None: it wrote none), and the file removed."""
        try:
            holder = self.path.read_text().strip()
            self.path.unlink()
        except OSError:
            return None
        return holder or None


def forget_holder(url: str, namespace: str, holder_file: HolderFile,
                  timeout_s: float) -> bool:
    """Delete a dead worker's heartbeat (the supervisor, after waitpid): its leases stop
    counting at its tenants' next admission. False if there was none, or Redis did not
    answer (they then stop counting when the heartbeat expires)."""
    holder = holder_file.take()
    if holder is None:
        return False
    client = redis.Redis.from_url(url, socket_timeout=timeout_s,  # one try: a supervisor
                                  socket_connect_timeout=timeout_s,  # waits on it
                                  retry=Retry(NoBackoff(), 0))
    try:
        client.delete(holder_key(namespace, holder))
    except RedisError as exc:
        log.warning("cannot free a dead worker's concurrency leases at once (%s): they stop "
                    "counting within tenancy.lease_holder_ttl_s", type(exc).__name__)
        return False
    finally:
        client.close()
    return True
