"""An admin write's audit entry, handed to the store that makes the write (`AUDITING`), so a
store that can fail half way (Redis) writes the entry in the same atomic step as the change:
its write scripts append it to the audit log, and a change Redis ran after the gateway gave up
waiting (a 503) is audited all the same. A store that writes nothing of it (in memory: its
writes cannot fail half way) leaves the admin route to append it after the write.

A context variable, not a parameter of every write: the store interface (and the in-memory
store) stays as it is, and only the writes an admin route makes inside
`AdminContext.audited` see one.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from gateway.tenancy.models import AuditEntry

__all__ = ["AUDITING", "RESULT", "AuditIntent"]

# a detail value the Redis write script replaces with its own result (a salt group's epoch,
# a policy's version): known only once the script has run
RESULT = "$result"


@dataclass(slots=True)
class AuditIntent:
    """The entry of the admin write under way; `written` once a store wrote it with the
    change, `open` until the route's write is over (a task that copied the context later
    must not write it with a change of its own)."""

    entry: AuditEntry
    written: bool = False
    open: bool = True

    def add(self, **detail: Any) -> None:
        """Detail known once the write is done (the route's view of its result)."""
        self.entry = self.entry.model_copy(update={"detail": {**self.entry.detail, **detail}})

    def pending(self, **detail: Any) -> str | None:
        """The entry as JSON for a store writing it with its change (`detail`: what the
        store knows of the write: `RESULT` for its script's result), None if none is due."""
        if not self.open or self.written:
            return None
        entry = self.entry.model_copy(update={"detail": {**self.entry.detail, **detail}})
        return entry.model_dump_json()


AUDITING: ContextVar[AuditIntent | None] = ContextVar("kvgate_auditing", default=None)
