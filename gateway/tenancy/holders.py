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

import logging
from pathlib import Path

from redis.exceptions import RedisError

from gateway.slot_note import SlotNote, one_try_redis

__all__ = ["HOLDER_TTL_S", "forget_holder", "holder_key", "holder_note"]

log = logging.getLogger(__name__)

HOLDER_TTL_S = 5.0
PREFIX = "lease-holder-"


def holder_key(namespace: str, holder: str) -> str:
    """The heartbeat key of a lease holder (a process)."""
    return f"{namespace}:lease-holder:{holder}"


def holder_note(directory: Path, slot: int) -> SlotNote:
    """Where a worker notes its lease holder id for its supervisor (``lease-holder-<slot>``);
    not noted, its leases outlive it by the heartbeat's TTL."""
    return SlotNote(directory, PREFIX, slot, "lease holder")


def forget_holder(url: str, namespace: str, holder_file: SlotNote,
                  timeout_s: float) -> bool:
    """Delete a dead worker's heartbeat (the supervisor, after waitpid): its leases stop
    counting at its tenants' next admission. False if there was none, or Redis did not
    answer (they then stop counting when the heartbeat expires)."""
    holder = holder_file.take()
    if holder is None:
        return False
    client = one_try_redis(url, timeout_s)
    try:
        client.delete(holder_key(namespace, holder))
    except RedisError as exc:
        log.warning("cannot free a dead worker's concurrency leases at once (%s): they stop "
                    "counting within tenancy.lease_holder_ttl_s", type(exc).__name__)
        return False
    finally:
        client.close()
    return True
