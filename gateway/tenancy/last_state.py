"""The tenancy state the workers of one gateway last loaded, kept where a restarted worker
finds it (`server.workers`).

A worker that dies (the OOM killer, ``kill -9``) is started again by the supervisor. While
Redis answers it loads the store like any gateway; while Redis is down it could load nothing
and answered every request 503 ("no API key or policy is loaded") and /readyz "not ready",
beside siblings that serve their last known state: an answer depended on which worker the
kernel handed the connection to. So every worker writes what it loaded from the store to its
own file in the supervisor's directory (``tenancy-state-<slot>.json``: private to the
gateway's user, removed when the supervisor exits, by the workers when it was killed), and
stamps it (its mtime) with when the read that loaded or last confirmed it began; a worker
whose first load fails starts from the file with the latest stamp, as stale as that stamp
says, and serves it degraded, exactly as its siblings do.

One file per worker, not one shared: two workers replacing one file raced. A slow writer's
older state could land over a newer one written meanwhile, and the other worker's next
confirmation touched the file, so the older state (a key revoked since in it) looked fresh
to a restarted worker. A file now holds only its worker's own states, written in order (one
refresh at a time), and its stamp is when that worker's read *began*, not when the write
or the touch landed: every change the store had made by then is in the state. So the latest
stamp is the state the store vouched for last, and a slow write never makes an older state
look newer. (Not a generation compare: a lower generation is no proof of an older state,
`TenantResolver`.) A restarted worker takes over its slot's file.

The file holds what the store holds: tenants, key *hashes* (never a key), the policy, salt
group epochs and the store's bootstrap marker (so a wipe noticed later is noticed by the
restarted worker too). It is written whole to a temporary name and renamed over the file, so
a reader sees one write or the other, never half of one. A file that cannot be read is
ignored (the worker then waits for Redis, as before), never trusted in part.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from gateway.tenancy.models import KeyRecord, PolicySnapshot, StoreSnapshot
from gateway.tenancy.store import policy_from_json, tenant_from_json, tenant_to_json

__all__ = ["LastState", "Saved"]

log = logging.getLogger(__name__)

FORMAT = 1  # bumped by an incompatible change; another version is ignored


@dataclass(frozen=True, slots=True)
class Saved:
    """What a restarted worker starts from."""

    snapshot: StoreSnapshot
    mark: str | None  # the store's bootstrap marker the state was read under
    age_s: float  # since the store last confirmed it (to any worker)


PREFIX = "tenancy-state-"


class LastState:
    """This worker's file of the last state loaded from the store, beside its siblings'."""

    def __init__(self, directory: Path, slot: int) -> None:
        self.directory = directory
        self.path = directory / f"{PREFIX}{slot}.json"
        self._tmp = directory / f".{PREFIX}{slot}.{os.getpid()}.tmp"
        self._kept: bytes | None = None  # the digest of the state last written
        self._written = False  # the state last loaded is in the file (as far as we know)

    async def keep(self, snap: StoreSnapshot, mark: str | None, read_at: float) -> None:
        """`save` a state just loaded by a read begun at `read_at` (wall clock), in a thread
        (10,000 keys take tens of ms to write, which the event loop must not wait for),
        unless it is what was written last.

        Compared by content, not by (generation, marker): the periodic whole reload finds
        the same generation most of the time, but also what changed behind the store's back
        without a new generation (a key record deleted in redis-cli to revoke it); the
        workers drop it then, and the file must too, or a worker restarted while Redis is
        down admits a key its siblings refuse."""
        await asyncio.to_thread(self._save_changed, snap, mark, read_at)

    def save(self, snap: StoreSnapshot, mark: str | None, read_at: float) -> None:
        """Write the state just loaded (best effort: a full disk only costs the restart)."""
        self._written = self._write(_dump(snap, mark), read_at)

    def _save_changed(self, snap: StoreSnapshot, mark: str | None, read_at: float) -> None:
        data = _dump(snap, mark)
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if digest != self._kept:
            self._written = self._write(data, read_at)
            self._kept = digest if self._written else None

    def _write(self, data: bytes, read_at: float) -> bool:
        try:
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.utime(self._tmp, (read_at, read_at))  # stamped before it can be read
            os.replace(self._tmp, self.path)
        except OSError as exc:
            log.warning("cannot keep the tenancy state for restarted workers: %s",
                        exc.strerror or type(exc).__name__)
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            return False
        return True

    def confirmed(self, read_at: float) -> None:
        """A read begun at `read_at` found our state current: the file is as fresh as that
        -- unless our last write failed (a full disk): the file then holds an older state (a
        key revoked since, perhaps), which must not look fresh."""
        if not self._written:
            return
        with contextlib.suppress(OSError):
            os.utime(self.path, (read_at, read_at))

    def load(self) -> Saved | None:
        """The state the store vouched for last among the workers' files (the latest
        stamp), or None (no file yet, or none readable)."""
        stamped: list[tuple[float, Path]] = []
        for path in self.directory.glob(f"{PREFIX}*.json"):
            with contextlib.suppress(FileNotFoundError):  # a sibling's, replaced meanwhile
                stamped.append((path.stat().st_mtime, path))
        for _, path in sorted(stamped, reverse=True):
            saved = _read(path)
            if saved is not None:
                return saved
        return None


def _read(path: Path) -> Saved | None:
    try:
        raw = path.read_bytes()
        age = max(0.0, time.time() - path.stat().st_mtime)
    except OSError as exc:
        log.warning("cannot read the tenancy state the other workers kept: %s",
                    exc.strerror or type(exc).__name__)
        return None
    try:
        return Saved(*_parse(raw), age_s=age)
    # pydantic's errors are ValueErrors; a list too short is an IndexError (uncaught, it
    # failed the worker's start, and the supervisor stopped every worker)
    except (ValueError, TypeError, LookupError) as exc:
        log.warning("the tenancy state the other workers kept is unreadable (%s); "
                    "ignored", type(exc).__name__)
        return None


def _dump(snap: StoreSnapshot, mark: str | None) -> bytes:
    return orjson.dumps({
        "format": FORMAT,
        "generation": snap.generation,
        "mark": mark,
        "tenants": [tenant_to_json(t) for t in snap.tenants.values()],
        # as arrays: a pydantic dump per key cost ~5 us, 50 ms for 10,000 keys
        "keys": [[k.key_id, k.tenant_id, k.key_hash, k.created_at]
                 for k in snap.keys.values()],
        "policy": None if snap.policy is None else
        [snap.policy.version, snap.policy.doc.model_dump_json(exclude_unset=True)],
        "group_epochs": snap.group_epochs,
    })


def _parse(raw: bytes) -> tuple[StoreSnapshot, str | None]:
    doc = orjson.loads(raw)
    if doc["format"] != FORMAT:
        raise ValueError("another format")
    tenants = [tenant_from_json(t) for t in doc["tenants"]]
    keys = [KeyRecord(key_id=i, tenant_id=t, key_hash=h, created_at=at)
            for i, t, h, at in doc["keys"]]
    policy = doc["policy"]
    epochs = doc["group_epochs"]
    if not (isinstance(epochs, dict) and all(type(v) is int for v in epochs.values())):
        raise TypeError("group_epochs")
    mark = doc["mark"]
    if mark is not None and not isinstance(mark, str):
        raise TypeError("mark")
    snap = StoreSnapshot(
        generation=int(doc["generation"]),
        tenants={t.id: t for t in tenants},
        keys={k.key_hash: k for k in keys},
        policy=None if policy is None else
        PolicySnapshot(int(policy[0]), policy_from_json(policy[1])),
        group_epochs=dict(epochs),
    )
    return snap, mark
