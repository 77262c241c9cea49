"""The shapes of the RESP2 replies the shared routing state reads: a stream's entries, an
entry id's time and order, Redis's clock from TIME."""

from __future__ import annotations

from typing import cast

__all__ = ["entries", "entry_key", "entry_ms", "time_ms"]


def entries(raw: object) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """A stream's entries from a RESP2 XRANGE/XREVRANGE reply (or one stream of XREAD's):
    ``[[id, [field, value, ...]], ...]``."""
    out = []
    for entry_id, flat in raw or ():  # type: ignore[attr-defined]
        out.append((entry_id, dict(zip(flat[::2], flat[1::2], strict=True))))
    return out


def time_ms(reply: object) -> int:
    """Redis's clock in milliseconds from its TIME reply (RESP2: ``[b"<s>", b"<us>"]``)."""
    seconds, micros = cast("list[bytes]", reply)
    return int(seconds) * 1000 + int(micros) // 1000


def entry_ms(entry_id: bytes) -> int:
    """The Redis-clock milliseconds of a stream entry id (``<ms>-<seq>``)."""
    return int(entry_id.split(b"-", 1)[0])


def entry_key(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id as numbers, in the stream's order."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
