"""A worker process's goodbye, said by its supervisor when the worker dies without saying it
(SIGKILL, the OOM killer): the other processes drop its load at once, as after a worker's own
goodbye on a clean stop, not when its records age out (``sync.stale_after_s``, 2 s).

Each worker notes its shared-state member id in the workers' directory when its sharing
starts (`MemberFile`); the supervisor, seeing it die, takes the id and appends the goodbye
record to the routes stream (`say_goodbye`): one XADD, bounded by ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from gateway.fleet.records import encode

__all__ = ["MemberFile", "say_goodbye"]

log = logging.getLogger(__name__)

_PREFIX = "sync-member-"


class MemberFile:
    """A worker's shared-state member id, where its supervisor finds it when it dies."""

    def __init__(self, directory: Path, slot: int) -> None:
        self.path = directory / f"{_PREFIX}{slot}"
        self._tmp = directory / f".{_PREFIX}{slot}.{os.getpid()}.tmp"

    def write(self, member: str) -> None:
        """Once, as the worker's sharing starts (a few bytes)."""
        try:
            self._tmp.write_text(member)
            os.replace(self._tmp, self.path)
        except OSError as exc:  # its load then ages out of the others' views
            log.warning("cannot note this worker's shared-state id for its supervisor: %s",
                        exc.strerror or type(exc).__name__)
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)

    def take(self) -> str | None:
        """The member id a dead worker wrote (None: none), and the file removed."""
        try:
            member = self.path.read_text().strip()
            self.path.unlink()
        except OSError:
            return None
        return member or None


def say_goodbye(url: str, namespace: str, member_file: MemberFile, timeout_s: float) -> bool:
    """Append a dead worker's goodbye to the routes stream (the supervisor, after waitpid).
    False if it noted no id or Redis did not answer (its load then ages out)."""
    member = member_file.take()
    if member is None:
        return False
    client = redis.Redis.from_url(url, socket_timeout=timeout_s,  # one try: a supervisor
                                  socket_connect_timeout=timeout_s,  # waits on it
                                  retry=Retry(NoBackoff(), 0))
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
