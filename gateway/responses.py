"""Responses API state: which replica holds a stored response.

With vLLM's response store on, a response lives only on the replica that created it; every
other replica answers 404 for it (as ``previous_response_id``, or on ``GET /v1/responses/{id}``
and ``POST /v1/responses/{id}/cancel``). The gateway remembers the id of every response it
relayed -> (tenant, pool, replica) in a bounded LRU, pins follow-ups to that replica and sends
the GET and cancel there. A tenant only ever reaches its own responses: an id remembered for
another tenant is answered as unknown, a follow-up naming it included (vLLM's store is keyed
by id alone and would continue the other tenant's conversation). An id this process never
relayed (another gateway replica's, or one evicted from the LRU) cannot be checked.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import NamedTuple

__all__ = ["ResponseHome", "ResponseStore", "response_id"]

# the response's own id (``resp_...``); the top-level `id` is the body's first field, and a
# stream's first event (``response.created``) carries it as ``response.id``. Items inside a
# response have other prefixes (``msg_``, ``rs_``, ``fc_``...).
_RESP_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_.\-]{1,200})"')


def response_id(blob: bytes) -> str | None:
    m = _RESP_ID.search(blob)
    return m.group(1).decode() if m else None


class ResponseHome(NamedTuple):
    tenant: str
    pool: str
    replica: str


class ResponseStore:
    """A bounded LRU: response id -> where it lives."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._capacity = capacity
        self._homes: OrderedDict[str, ResponseHome] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, rid: str, tenant: str, pool: str, replica: str) -> None:
        self._homes[rid] = ResponseHome(tenant, pool, replica)
        self._homes.move_to_end(rid)
        if len(self._homes) > self._capacity:
            self._homes.popitem(last=False)

    def foreign(self, rid: str, tenant: str) -> bool:
        """`rid` is known here as another tenant's response."""
        found = self._homes.get(rid)
        return found is not None and found.tenant != tenant

    def home(self, rid: str, tenant: str) -> ResponseHome | None:
        """Where `rid` lives, if it was created for `tenant` (else None)."""
        found = self._homes.get(rid)
        if found is None or found.tenant != tenant:
            return None
        self._homes.move_to_end(rid)
        return found
