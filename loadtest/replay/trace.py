"""Reading a Mooncake-format trace: one request a line, every field checked.

A line is a JSON object with ``timestamp`` (arrival, milliseconds), ``input_length`` and
``output_length`` (tokens) and ``hash_ids`` (the prompt's block ids, 512 tokens a block in the
Mooncake release); other fields are ignored. Users bring traces written by their own tools, so a
wrong line stops the replay with its number and the field named: before this, a string or
float block id or one above 2**63 ended in a traceback from the hashing, and a negative,
fractional or boolean length was replayed as if it were a number of tokens.

Read as well: a gzip-, bzip2- or xz-compressed file (told by its first bytes, whatever its
name), a pipe, a UTF-8 byte order mark, CRLF line ends, blank lines, and NaN or Infinity (as
Python's json module writes them) in a field the replay ignores. A UTF-16 file and a zstd or
zip archive are named as such. `notes` names what reads but looks wrong (a trace in seconds or
microseconds, block ids that do not cover the prompt).
"""

from __future__ import annotations

import bz2
import gc
import gzip
import json
import lzma
import math
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

import orjson

__all__ = ["MAX_TOKENS", "TraceError", "TraceRow", "collector_paused", "notes", "read_rows"]

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MAX_TOKENS = 1 << 24  # far beyond any model's context: a larger length is a corrupt field
_GZIP_MAGIC = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"
_I64_MIN, _U64_END = -(1 << 63), 1 << 64


class TraceError(ValueError):
    """The trace cannot be replayed; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    line: int  # 1-based, in the file
    timestamp: int | float  # milliseconds, as written
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # signed 64-bit (ids of 2**63 and above wrap, one to one)


def read_rows(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """The first `limit` requests of the file in file order (blank lines skipped).

    `OSError` when the file cannot be opened, `TraceError` for a line that is not a request."""
    rows: list[TraceRow] = []
    with _lines(path) as lines, collector_paused():
        for n, raw in enumerate(lines, 1):
            if limit is not None and len(rows) >= limit:
                break
            if n == 1:
                raw = raw.removeprefix(_BOM)
            if raw.strip():
                rows.append(_row(n, raw))
    return rows


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cycle collector off while a trace's requests are built: they hold no cycle, and its
    passes over the growing heap took a third of the time to load a million-line trace."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextmanager
def _lines(path: str | Path) -> Iterator[Iterator[bytes]]:
    with open(path, "rb") as f:
        head = f.peek(6)[:6]  # peek, not seek: a pipe (`<(zcat ...)`, /dev/stdin) reads too
        for magic, what in _REFUSED.items():
            if head.startswith(magic):
                raise TraceError(f"line 1: the file is {what}")
        unpacked = _unpacker(head, f)
        if unpacked is None:
            yield iter(f)
            return
        with unpacked:
            yield _unpacked(unpacked)


_REFUSED = {  # said in words: orjson's "not valid UTF-8" at column 1 named no cause
    b"\x28\xb5\x2f\xfd": "zstd-compressed: decompress it (gzip, bzip2 and xz are read as is)",
    b"PK\x03\x04": "a zip archive: unpack the trace from it",
    b"\xff\xfe": "UTF-16 text: save it as UTF-8",
    b"\xfe\xff": "UTF-16 text: save it as UTF-8",
}


def _unpacker(head: bytes, f: IO[bytes]) -> gzip.GzipFile | bz2.BZ2File | lzma.LZMAFile | None:
    """A compressed trace is read as it is, told by its first bytes whatever its name."""
    if head.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=f)  # the caller closes it
    if head.startswith(b"BZh"):
        return bz2.BZ2File(f)
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(f)
    return None


def _unpacked(stream: Iterable[bytes]) -> Iterator[bytes]:
    n = 0
    try:
        for n, raw in enumerate(stream, 1):  # noqa: B007 (n: where a damaged archive stopped)
            yield raw
    except (EOFError, OSError, zlib.error, lzma.LZMAError) as exc:  # BadGzipFile: an OSError
        raise TraceError(f"line {n + 1}: the compressed data is damaged or cut short "
                         f"({exc or type(exc).__name__})") from None


def _row(n: int, raw: bytes) -> TraceRow:
    obj = _parsed(n, raw)
    if not isinstance(obj, dict):
        raise TraceError(f"line {n}: {_shown(obj)} is not a JSON object with the fields "
                         f"{', '.join(FIELDS)}")
    missing = [k for k in FIELDS if k not in obj]
    if missing:
        raise TraceError(f"line {n}: no {', '.join(missing)} (a request needs "
                         f"{', '.join(FIELDS)})")
    ts = obj["timestamp"]
    if type(ts) not in (int, float) or not _finite(ts):  # bool: an int subclass, excluded
        raise TraceError(f"line {n}: timestamp {_shown(ts)} is not a finite number "
                         f"(milliseconds)")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceError(f"line {n}: hash_ids {_shown(ids)} is not a list of block ids")
    return TraceRow(n, ts, _tokens(n, obj, "input_length", 1), _tokens(n, obj, "output_length", 0),
                    _block_ids(n, ids))


def _parsed(n: int, raw: bytes) -> object:
    """The line's JSON value. Python's json module writes NaN and Infinity for a float field;
    orjson refuses them, which named neither field nor value: such a line is read again by
    the standard library's parser, so that a NaN in an ignored field is ignored and one in a
    request field is named with it."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        error = exc
    try:
        return json.loads(raw)
    except ValueError:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise TraceError(f"line {n}: not JSON ({error.msg}, column {error.colno})") from None


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer of hundreds of digits, read by the fallback parser
        return False


def _tokens(n: int, obj: dict[str, object], name: str, least: int) -> int:
    value = obj[name]
    if type(value) is float and value.is_integer():
        value = int(value)  # 600.0: a whole number written by a float-minded tool
    if type(value) is not int or not least <= value <= MAX_TOKENS:
        raise TraceError(f"line {n}: {name} {_shown(value)} is not a whole number of tokens "
                         f"from {least} to {MAX_TOKENS}")
    return value


def _block_ids(n: int, ids: list[object]) -> tuple[int, ...]:
    if all(type(v) is int and _I64_MIN <= v < 1 << 63 for v in ids):
        return tuple(cast(list[int], ids))  # the common case: signed 64-bit ids
    for v in ids:
        if type(v) is not int or not _I64_MIN <= v < _U64_END:  # orjson reads larger as float
            raise TraceError(f"line {n}: hash_ids holds {_shown(v)}: block ids are integers of "
                             f"at most 64 bits")
    # unsigned 64-bit ids: one to one onto the signed ones
    return tuple(v - _U64_END if v >= 1 << 63 else v for v in cast(list[int], ids))


def _shown(value: object) -> str:
    # the standard library's writer: NaN as NaN (orjson wrote null), any integer's digits
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= 40 else f"{text[:37]}..."


def notes(rows: Sequence[TraceRow], block_tokens: int, rate_scale: float = 1.0) -> list[str]:
    """What reads but probably is not what the trace meant: arrivals (after `rate_scale`) over
    1,000 a second, or under one an hour on average or spread over more than a day (timestamps
    in seconds or microseconds?),
    block ids that do not cover the prompts in blocks of `block_tokens`."""
    out = []
    stamps = [r.timestamp for r in rows]
    span_s = (max(stamps) - min(stamps)) / 1000.0 / rate_scale
    scaled = f" at --rate-scale {rate_scale:g}" if rate_scale != 1.0 else ""
    if len(rows) >= 10 and span_s * 1000.0 < len(rows):
        out.append(f"the trace's {len(rows)} requests arrive within {span_s:.3g} s{scaled} "
                   f"(timestamps are milliseconds; if they are seconds, --rate-scale 0.001 "
                   f"reads them so)")
    elif span_s > 86_400.0 or (len(rows) >= 10 and span_s / (len(rows) - 1) > 3600.0):
        # (a day: a microsecond trace of a few minutes at a production rate averaged far over
        # one an hour, so went unwarned, and a live replay of it would have taken days)
        out.append(f"the trace's {len(rows)} requests span {span_s / 86_400:.3g} days{scaled} "
                   f"(timestamps are milliseconds; if they are microseconds, --rate-scale "
                   f"1000 reads them so)")
    off = sum(1 for r in rows if len(r.hash_ids) != math.ceil(r.input_length / block_tokens))
    if off:
        out.append(f"{off} of {len(rows)} requests have a hash_ids list whose length is not "
                   f"input_length / {block_tokens} rounded up: tokens past the last id are "
                   f"shared with no other request, ids past the prompt are ignored")
    return out
