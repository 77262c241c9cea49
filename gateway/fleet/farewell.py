"""A worker process's goodbye, said by its supervisor when the worker dies without saying it
(SIGKILL, the OOM killer): the other processes drop its load at once, as after a worker's own
goodbye on a clean stop, not when its records age out (``sync.stale_after_s``, 2 s).

Each worker notes its shared-state member id in the workers' directory when its sharing
starts (`member_note`); the supervisor, seeing it die, takes the id and appends the goodbye
record to the routes stream (`say_goodbye`): one XADD, bounded by ``timeout_s``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from gateway.fleet.records import encode
from gateway.slot_note import SlotNote, one_try_redis

__all__ = ["member_note", "say_goodbye"]

log = logging.getLogger(__name__)

_PREFIX = "sync-member-"


def member_note(directory: Path, slot: int) -> SlotNote:
    """Where a worker notes its shared-state member id for its supervisor
    (``sync-member-<slot>``); not noted, its load ages out of the others' views."""
    return SlotNote(directory, _PREFIX, slot, "shared-state id")


def say_goodbye(url: str, namespace: str, member_file: SlotNote, timeout_s: float) -> bool:
    """Append a dead worker's goodbye to the routes stream (the supervisor, after waitpid).
    False if it noted no id or Redis did not answer (its load then ages out)."""
    member = member_file.take()
    if member is None:
        return False
    client = one_try_redis(url, timeout_s)
    try:
        fields: dict[Any, Any] = encode(member, time.time(), [], {}, bye=True)
        client.xadd(f"{namespace}:routes", fields)
    except RedisError as exc:
        log.warning("cannot say a dead worker's goodbye to the other gateways (%s): its load "
                    "leaves their views within sync.stale_after_s", type(exc).__name__)
        return False
    finally:
        client.close()
    return True
