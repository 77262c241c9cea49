"""What a worker of ``server.workers`` > 1 leaves for its supervisor to act on when it dies
without a word (SIGKILL, the OOM killer): an id noted in a file of its slot in the
supervisor's directory (`SlotNote`: its lease holder, `gateway.tenancy.holders`; its
shared-state member, `gateway.fleet.farewell`), and the client the supervisor acts with
(`one_try_redis`: one try, bounded, as the supervisor waits on it)."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = ["SlotNote", "one_try_redis"]

log = logging.getLogger(__name__)


class SlotNote:
    """An id a worker notes for its supervisor (``what``, for the log), in the file
    ``<prefix><slot>`` of the supervisor's directory."""

    def __init__(self, directory: Path, prefix: str, slot: int, what: str) -> None:
        self.path = directory / f"{prefix}{slot}"
        self._tmp = directory / f".{prefix}{slot}.{os.getpid()}.tmp"
        self._what = what

    def write(self, value: str) -> None:
        """Once, as the worker starts what the id names (a few bytes, on the caller's
        thread). Not written, the supervisor cannot act for it: what it holds then
        outlives it until it expires."""
        try:
            self._tmp.write_text(value)
            os.replace(self._tmp, self.path)
        except OSError as exc:
            log.warning("cannot note this worker's %s for its supervisor: %s", self._what,
                        exc.strerror or type(exc).__name__)
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)

    def take(self) -> str | None:
        """The id a dead worker noted (None: none), and the file removed."""
        try:
            value = self.path.read_text().strip()
            self.path.unlink()
        except OSError:
            return None
        return value or None


def one_try_redis(url: str, timeout_s: float) -> redis.Redis:
    """A client for the supervisor's one command: one try, each step bounded by
    ``timeout_s`` (the supervisor waits on it). The caller closes it."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
