"""The log's word on stream entries the shared routing state drops (`records.decode` refused
them): once per format version, and once for malformed entries, per process.

A rolling upgrade whose gateways cannot read each other's records (an incompatible format:
`records.VERSION`) shared no routing state between the two versions, and only a counter
(``kvgate_sync_records_dropped_total``) said so. The writer is named by its member id (host,
pid), cut short and only when printable; nothing else of the entry is shown: anyone may
write to the stream.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from gateway.fleet.records import VERSION

__all__ = ["DroppedEntries"]

log = logging.getLogger("gateway.fleet.sync")  # the shared routing state's lines


def _shown(raw: bytes, limit: int) -> str:
    text = raw[:limit].decode(errors="replace")
    return text if text.isprintable() else "?"


class DroppedEntries:
    def __init__(self, stream: str, member: str) -> None:
        self._stream = stream
        self._member = member
        self._said: set[str] = set()

    def said(self, fields: Mapping[bytes, bytes], reason: str) -> None:
        """An entry dropped for ``reason`` (``version`` or ``malformed``): logged if it is the
        first of its kind here."""
        version = _shown(fields.get(b"v", b""), 16)
        kind = f"version {version}" if reason == "version" else reason
        if kind in self._said:
            return
        self._said.add(kind)
        writer = _shown(fields.get(b"m", b"?"), 80)
        extra = {"member": self._member}
        if reason == "version":
            log.warning("shared routing state: entries of format version %r from %s are "
                        "dropped (this gateway reads version %r): a kvgate of another "
                        "version? Gateways share routing state only with those that read "
                        "their format", version, writer, VERSION.decode(), extra=extra)
        else:
            log.warning("shared routing state: a malformed entry in %s from %s is dropped "
                        "(something else writes to it?); further ones are only counted "
                        "(kvgate_sync_records_dropped_total)", self._stream, writer,
                        extra=extra)
