"""An admin write is in force on this gateway when its answer goes out, or the answer says not.

The admin API writes to the tenancy store; the request path reads the resolver's in-memory
copy, which follows the store on a change notification or its poll (`TenantResolver`). Without
waiting for that, a client that creates a key and uses it at once through the same gateway
got a 401 (about one time in five; three in five for a new tenant's first key), and a revoked
key still worked for a moment. `read_your_writes` wraps the admin app: before a successful
answer to a write (any method but GET/HEAD) starts, the resolver is brought up to date, and
the answer carries ``x-kvgate-in-force: true``. When that reload fails (Redis went away
between the write and the reload, or its data could not be read) the write is stored but
not in force here until the store answers again (a revoked key still works here meanwhile,
for at most ``tenancy.max_staleness_s``): the answer says ``x-kvgate-in-force: false`` and
the log says so once per such write. Other gateways follow within the store's notification
delay, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.asgi import Receive, Scope, Send

__all__ = ["IN_FORCE_HEADER", "read_your_writes"]

IN_FORCE_HEADER = "x-kvgate-in-force"

log = logging.getLogger(__name__)


def read_your_writes(app: Any, refresh: Callable[[], Awaitable[bool]]) -> Any:
    """Wrap an ASGI app whose writes `refresh()` (False: it failed) makes visible to the
    request path."""

    async def synced(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            await app(scope, receive, send)
            return

        async def send_after_refresh(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                in_force = await refresh()
                if not in_force:
                    log.warning("admin write stored but not in force on this gateway yet: the "
                                "tenancy store did not answer the reload after it (in force "
                                "once it answers; the answer says %s: false)", IN_FORCE_HEADER,
                                extra={"method": scope.get("method"), "path": scope.get("path")})
                value = b"true" if in_force else b"false"
                headers = [*message.get("headers", ()), (IN_FORCE_HEADER.encode(), value)]
                message = {**message, "headers": headers}
            await send(message)

        await app(scope, receive, send_after_refresh)

    return synced
