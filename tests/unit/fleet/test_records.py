"""The shared routing state's wire format: round trips, and every malformed shape refused."""

from __future__ import annotations

import struct

import orjson
import pytest

from gateway.fleet.records import VERSION, BadRecord, UnknownVersion, decode, encode
from routing.peers import ReplicaLoad, RouteRecord

ROUTES = [RouteRecord("10.0.0.1:8000", (1, 2**64 - 1, 42), 0),
          RouteRecord("10.0.0.2:8000", (7,), 12)]
LOADS = {"10.0.0.1:8000": ReplicaLoad(3, 1, 900, 450.5), "10.0.0.2:8000": ReplicaLoad()}


def test_round_trip() -> None:
    batch = decode(encode("host:1:abc", 1_700_000_000.25, ROUTES, LOADS))
    assert batch.member == "host:1:abc"
    assert batch.sent_at == 1_700_000_000.25
    assert batch.routes == ROUTES
    assert batch.loads == LOADS
    assert not batch.bye and not batch.whole


def test_a_whole_load_is_marked() -> None:
    assert decode(encode("m", 1.0, [], LOADS, whole=True)).whole


def test_goodbye_and_empty_batches() -> None:
    batch = decode(encode("m", 1.0, [], {}, bye=True))
    assert batch.bye and batch.routes == [] and batch.loads == {}


def test_unknown_fields_are_ignored() -> None:
    fields = encode("m", 1.0, ROUTES, {})
    fields[b"x-future"] = b"whatever"
    assert decode(fields).routes == ROUTES


@pytest.mark.parametrize("version", [b"2", b"0", b""])
def test_unknown_versions_are_refused(version: bytes) -> None:
    fields = encode("m", 1.0, ROUTES, LOADS)
    fields[b"v"] = version
    with pytest.raises(UnknownVersion):
        decode(fields)


def test_an_entry_without_a_version_is_malformed_not_another_version() -> None:
    """Every kvgate writes ``v``: an entry without it is something else's (counted and said
    as malformed; it was said as 'a kvgate of another version')."""
    fields = encode("m", 1.0, ROUTES, LOADS)
    del fields[b"v"]
    with pytest.raises(BadRecord) as refused:
        decode(fields)
    assert not isinstance(refused.value, UnknownVersion)


def _with(**changes: bytes) -> dict[bytes, bytes]:
    fields = encode("m", 1.0, ROUTES, LOADS)
    for k, v in changes.items():
        fields[k.encode()] = v
    return fields


@pytest.mark.parametrize("fields", [
    {b"v": VERSION},  # no member, no time
    _with(m=b""),
    _with(t=b"yesterday"),
    _with(t=b"-5"),
    _with(m=b"\xff\xfe"),
    _with(r=b"not json"),
    _with(r=b'{"a": 1}'),
    _with(r=orjson.dumps([["r", 0]])),  # head too short
    _with(r=orjson.dumps([["r", -1, 1]])),  # negative tail
    _with(r=orjson.dumps([["r", 0, 0]])),  # empty chain
    _with(r=orjson.dumps([[1, 0, 1]])),  # replica not a string
    _with(r=orjson.dumps([["x" * 300, 0, 1]])),  # not a replica id
    _with(h=b"\x00" * 7),  # not whole 64-bit words
    _with(h=b"\x00" * 8),  # fewer hashes than the heads say
    _with(h=b"\x00" * 8 * 9),  # more hashes than the heads say
    _with(l=b"[1, 2]"),
    _with(l=orjson.dumps({"r": [1, 2, 3]})),
    _with(l=orjson.dumps({"r": [-1, 0, 0, 0]})),
    _with(l=orjson.dumps({"r": [1.5, 0, 0, 0]})),
    _with(l=orjson.dumps({"r": [1, 0, 0, "x"]})),
    _with(l=orjson.dumps({"r": [1, 0, 0, True]})),
    _with(l=orjson.dumps({"r": [1, 0, 0, -0.5]})),
])
def test_malformed_batches_are_refused(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(BadRecord):
        decode(fields)


def test_hashes_are_little_endian_unsigned_64_bit_words() -> None:
    """The wire every reader of format 1 expects, whatever array type packs it here."""
    fields = encode("m", 1.0, ROUTES, {})
    assert fields[b"h"] == struct.pack("<4Q", 1, 2**64 - 1, 42, 7)


def test_hashes_are_packed_not_spelled_out() -> None:
    chain = tuple(range(1, 257))
    fields = encode("m", 1.0, [RouteRecord("r", chain, 0)], {})
    assert len(fields[b"h"]) == 8 * 256
