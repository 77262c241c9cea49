"""An admin write is in force on this gateway when its answer goes out.

The admin API writes to the tenancy store; the request path reads the resolver's in-memory
copy, which follows the store on a change notification or its poll (`TenantResolver`). Without
waiting for that, a client that creates a key and uses it at once through the same gateway
got a 401 (about one time in five; three in five for a new tenant's first key), and a revoked
key still worked for a moment. `read_your_writes` wraps the admin app: before a successful
answer to a write (any method but GET/HEAD) starts, the resolver is brought up to date.
Other gateways follow within the store's notification delay, as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.asgi import Receive, Scope, Send

__all__ = ["read_your_writes"]


def read_your_writes(app: Any, refresh: Callable[[], Awaitable[object]]) -> Any:
    """Wrap an ASGI app whose writes `refresh()` makes visible to the request path."""

    async def synced(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            await app(scope, receive, send)
            return

        async def send_after_refresh(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                await refresh()
            await send(message)

        await app(scope, receive, send_after_refresh)

    return synced
