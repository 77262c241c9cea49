"""The wire format of shared routing state: one Redis Stream entry = one batch of one gateway.

Fields of an entry (all bytes; unknown fields are ignored, so a newer writer may add some):

    v  format version (b"1"); a reader drops versions it does not know and counts them, so
       a rolling upgrade never feeds a reader a format it would misread -- an incompatible
       change bumps ``v`` and writers publish the old version until every reader knows both.
       Every kvgate writes it: an entry without it is not a batch (malformed, not a version)
    m  the writer's member id (host:pid:random)
    t  the writer's wall clock at publication, seconds (read by older readers; this one
       judges time by the entry's id, Redis's clock: apply lag, peers live at start)
    r  JSON list of routes, ``[[replica, tail_blocks, n_blocks], ...]``
    h  the routes' block hashes, concatenated, little-endian unsigned 64-bit (8 x n bytes)
    l  JSON object of the writer's own load that changed, ``{replica: [inflight, prefill,
       prefill_tokens, pending_work]}`` (zero: the writer has nothing there any more)
    b  present: the writer is leaving (clean shutdown); drop its load now
    w  present: ``l`` holds the writer's whole non-zero load (a heartbeat): a replica it
       leaves out is zero. A zero record is sent once, and one the reader never got (the
       stream wiped before it read it) left the writer's finished requests in its view for
       as long as the writer lived. Older readers ignore the field (and keep that fault).

Hashes travel as packed integers, not JSON: a 256-block chain is 2 KiB instead of ~5 KiB and
packs and unpacks in one call (a batch's hashes unpack into one tuple, each route's chain is a
slice of it). Everything a reader gets is validated here: a malformed entry
raises `BadRecord` (counted and skipped), never reaches the router.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter

import orjson

from routing.peers import ReplicaLoad, RouteRecord

__all__ = ["VERSION", "BadRecord", "Batch", "UnknownVersion", "decode", "encode"]

VERSION = b"1"
_SWAP = sys.byteorder == "big"  # the wire is little-endian
# an unsigned 64-bit array type: "L" packs an int with a digit loop, "Q" through the generic
# int-to-bytes conversion, ~2.5x the instructions (CPython 3.11); "L" is 64-bit on LP64 only
_U64 = "L" if array("L").itemsize == 8 else "Q"
_HASHES = attrgetter("hashes")
# a `RouteRecord` from its fields' tuple in C (a named tuple's own __new__ is Python code)
_record = tuple.__new__
_MAX_ID = 256  # a replica id longer than this is not ours
_NUMBER = (int, float)  # JSON numbers (bool is neither: its type is bool)


class BadRecord(ValueError):
    """An entry that is not a valid batch (truncated, wrong types, inconsistent lengths)."""


class UnknownVersion(BadRecord):
    """An entry of a format version this reader does not know (e.g. from a newer writer)."""


@dataclass(slots=True)
class Batch:
    member: str
    sent_at: float
    routes: list[RouteRecord] = field(default_factory=list)
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)
    bye: bool = False
    whole: bool = False  # `loads` is all of the writer's non-zero load


def _pack(hashes: Sequence[int]) -> bytes:
    a = array(_U64, hashes)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _packed(routes: Sequence[RouteRecord]) -> bytes:
    """The routes' hashes, concatenated; on a little-endian machine each route's array goes
    straight to the join (its buffer), with no Python frame per route."""
    chains = map(_HASHES, routes)
    if _SWAP:
        return b"".join(map(_pack, chains))
    return b"".join(map(partial(array, _U64), chains))


def encode(
    member: str, sent_at: float, routes: Sequence[RouteRecord],
    loads: Mapping[str, ReplicaLoad], bye: bool = False, whole: bool = False,
) -> dict[bytes, bytes]:
    """A batch as the fields of one stream entry."""
    fields = {b"v": VERSION, b"m": member.encode(), b"t": repr(sent_at).encode()}
    if routes:
        fields[b"r"] = orjson.dumps([[r.replica, r.tail_blocks, len(r.hashes)] for r in routes])
        fields[b"h"] = _packed(routes)
    if loads:
        fields[b"l"] = orjson.dumps({
            k: [x.inflight, x.prefill, x.prefill_tokens, round(x.pending_work, 1)]
            for k, x in loads.items()
        })
    if bye:
        fields[b"b"] = b"1"
    if whole:
        fields[b"w"] = b"1"
    return fields


def decode(fields: Mapping[bytes, bytes]) -> Batch:
    """One stream entry back into a `Batch`; `BadRecord` / `UnknownVersion` when it is not."""
    version = fields.get(b"v")
    if version != VERSION:
        if version is None:  # no kvgate writes one: something else writes to the stream
            raise BadRecord("no version")
        raise UnknownVersion(f"version {version!r}")
    try:
        member = fields[b"m"].decode()
        sent_at = float(fields[b"t"])
        batch = Batch(member, sent_at, bye=b"b" in fields, whole=b"w" in fields)
        if b"r" in fields:
            batch.routes = _routes(orjson.loads(fields[b"r"]), fields.get(b"h", b""))
        if b"l" in fields:
            batch.loads = _loads(orjson.loads(fields[b"l"]))
    except (KeyError, ValueError, TypeError, UnicodeDecodeError, orjson.JSONDecodeError) as exc:
        if isinstance(exc, BadRecord):
            raise
        raise BadRecord(type(exc).__name__) from None
    if not member or not 0.0 <= sent_at < 1e11:
        raise BadRecord("member or time")
    return batch


def _routes(heads: object, packed: bytes) -> list[RouteRecord]:
    if not isinstance(heads, list) or len(packed) % 8:
        raise BadRecord("routes")
    hashes = struct.unpack(f"<{len(packed) >> 3}Q", packed)
    out: list[RouteRecord] = []
    at = 0
    for head in heads:
        if not (isinstance(head, list) and len(head) == 3):
            raise BadRecord("route head")
        replica, tail, n = head
        if not (isinstance(replica, str) and 0 < len(replica) <= _MAX_ID
                and type(tail) is int and type(n) is int and tail >= 0 and n > 0):
            raise BadRecord("route head")
        out.append(_record(RouteRecord, (replica, hashes[at:at + n], tail)))
        at += n
    if at != len(hashes):
        raise BadRecord("hash count")
    return out


def _loads(raw: object) -> dict[str, ReplicaLoad]:
    if not isinstance(raw, dict):
        raise BadRecord("loads")
    out: dict[str, ReplicaLoad] = {}
    for replica, v in raw.items():
        if not (type(v) is list and len(v) == 4 and len(replica) <= _MAX_ID):
            raise BadRecord("load")
        inflight, prefill, tokens, work = v
        if not (type(inflight) is int and type(prefill) is int and type(tokens) is int
                and type(work) in _NUMBER and inflight >= 0 and prefill >= 0 and tokens >= 0
                and work >= 0):
            raise BadRecord("load")
        out[replica] = ReplicaLoad(inflight, prefill, tokens, float(work))
    return out
