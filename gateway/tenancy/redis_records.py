"""Reading the Redis tenancy store's stored values (`redis_store`): a record that does not
parse is left out and reported (`SkippedRecord`), never the whole load failed; salt-group
epochs as HINCRBY writes them; the generation counter as INCR counts it; the change journal's
entries; pub/sub change messages."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from gateway.errors import StoreUnreachable, UnreadableRecord
from gateway.tenancy.key_types import WRONG_TYPE, bumpable
from gateway.tenancy.models import AuditEntry, Change, PolicySnapshot, SkippedRecord
from gateway.tenancy.store import policy_from_json

__all__ = ["MAX_EPOCH", "ParsedOnce", "audit_from_json", "changed_keys", "counter",
           "parse_change", "parsed_before", "policy_from", "read_epoch", "read_record",
           "readable_records", "skipped_record", "text", "texts", "unreadable_policy"]

T = TypeVar("T")


def counter(raw: str | bytes | None) -> int:
    """The generation counter (0 while absent). One that holds no integer (written by hand)
    is a key of the wrong type (`StoreUnreachable` WRONGTYPE, as the scripts refuse it;
    `key_types.misplaced` names it), not unreadable data: no reload or write can use it."""
    if raw is None:
        return 0
    value = text(raw)
    if not bumpable(value):
        raise StoreUnreachable(WRONG_TYPE)
    return int(value)


def changed_keys(
    journal: list[str], since: int, now: int, head: str | None
) -> list[str] | None:
    """The key hashes the journal (newest entry first) names for generations after `since`
    up to `now`; None unless it holds an entry for each of them and reaches back to `head`,
    its newest entry at `since` (so nothing of theirs was trimmed away, and it is the same
    journal)."""
    if now <= since:
        return None
    seen: set[int] = set()
    hashes: dict[str, None] = {}
    for entry in journal:
        parts = entry.split(" ", 2)
        if len(parts) != 3 or not (parts[0].isascii() and parts[0].isdigit()):
            return None
        generation, kind, name = int(parts[0]), parts[1], parts[2]
        if generation <= since:
            whole = entry == head and seen == set(range(since + 1, now + 1))
            return list(hashes) if whole else None
        if generation <= now:
            seen.add(generation)
            if kind == "key":
                hashes[name] = None
    return None


def text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode()


def texts(raw: dict[Any, Any]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


def policy_from(raw: dict[str, str], skipped: list[SkippedRecord]) -> PolicySnapshot | None:
    if not raw:
        return None
    try:
        return PolicySnapshot(int(raw["version"]), policy_from_json(raw["doc"]))
    except (KeyError, ValueError):  # pydantic's ValidationError is a ValueError
        skipped.append(skipped_record("policy", "policy", json.dumps(raw, sort_keys=True)))
        return None


def audit_from_json(raw: str) -> AuditEntry:
    return AuditEntry.model_validate_json(raw, extra="ignore")


def unreadable_policy() -> UnreadableRecord:
    return UnreadableRecord(
        "the stored policy document is unreadable (corrupted, or written by another kvgate "
        "version in a form this one cannot read); store a whole new one with PUT /admin/policy "
        "(kvgate admin policy put FILE)")


MAX_EPOCH = 2**63 - 1  # Redis's integers: HINCRBY counts no further


def read_epoch(raw: str) -> int:
    """A salt group's epoch: a decimal integer from 0 to `MAX_EPOCH` without leading zeros,
    as HINCRBY writes it, nothing else. Python's int() would also take ``+1``, ``1_0``,
    spaces, ``007`` or any size, which HINCRBY refuses to count on from: such a value read as
    valid here made every rotation of the group fail (a 503) while its tenants were served."""
    if not (raw.isascii() and raw.isdigit()) or (raw[0] == "0" and raw != "0"):
        raise ValueError("not an epoch")
    value = int(raw)
    if value > MAX_EPOCH:
        raise ValueError("not an epoch")
    return value


def read_record(raw: str, parse: Callable[[str], T]) -> T | None:
    try:
        return parse(raw)
    except ValueError:  # not JSON, or not a record (pydantic's ValidationError)
        return None


def readable_records(
    raw: dict[str, str], parse: Callable[[str], T], kind: str, skipped: list[SkippedRecord]
) -> dict[str, T]:
    """`raw`'s records that parse; the others are added to `skipped`."""
    out: dict[str, T] = {}
    for name, value in raw.items():
        record = read_record(value, parse)
        if record is None:
            skipped.append(skipped_record(kind, name, value))
        else:
            out[name] = record
    return out


class ParsedOnce(Generic[T]):
    """`readable_records` of one hash read again and again (the tenants, at every reload):
    a record whose stored text did not change is not parsed again, and is the same object
    as before (`TenantResolver` keeps the principal of a tenant whose record is)."""

    def __init__(self, parse: Callable[[str], T]) -> None:
        self._parse = parse
        self._seen: dict[str, tuple[str, T | None]] = {}

    def readable(self, raw: dict[str, str], kind: str, skipped: list[SkippedRecord]
                 ) -> dict[str, T]:
        seen, now, out = self._seen, {}, {}
        for name, value in raw.items():
            hit = seen.get(name)
            record = hit[1] if hit is not None and hit[0] == value else (
                read_record(value, self._parse))
            now[name] = (value, record)
            if record is None:
                skipped.append(skipped_record(kind, name, value))
            else:
                out[name] = record
        self._seen = now
        return out


def parsed_before(
    raw: dict[str, str], seen: dict[str, tuple[str, T | None]], parse: Callable[[str], T]
) -> dict[str, T]:
    """`raw`'s readable records, each taken from `seen` (name -> (text, record) of the last
    load) when its text is the one loaded: a page of 1,000 tenants' 10,000 keys parsed them
    all again (~140 ms of the ~400 ms the page held the gateway's event loop)."""
    out: dict[str, T] = {}
    for name, value in raw.items():
        hit = seen.get(name)
        record = hit[1] if hit is not None and hit[0] == value else read_record(value, parse)
        if record is not None:
            out[name] = record
    return out


def skipped_record(kind: str, name: str, value: str) -> SkippedRecord:
    # a key's name is its hash: never shown whole (a log line or /readyz must not hand out
    # something to match a key against)
    shown = f"{name[:8]}..." if kind == "key" else name
    return SkippedRecord(kind, shown, hashlib.sha256(f"{name}\0{value}".encode()).hexdigest())


def parse_change(data: Any) -> Change:
    try:
        parsed = json.loads(data)
        return Change(str(parsed.get("kind", "resync")), parsed.get("id"))
    except (TypeError, ValueError, AttributeError):
        return Change("resync")
