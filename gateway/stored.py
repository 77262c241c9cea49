"""``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the replica that
holds the stored response (`ResponseStore`), as the tenant that created it. ``HEAD`` is GET
without the body: the replica is asked with GET, the server leaves the body out.

Authentication is the proxied routes' (the bearer key -> tenant); an id this gateway did not
relay for this tenant is a 404 in OpenAI's shape, as vLLM itself answers for an unknown id.
The answer is relayed whole; an error body that is not OpenAI-shaped is re-shaped; a replica
refusing kvgate's own credentials (401/403) is a 502 (`ReplicaRefused`).
"""

from __future__ import annotations

import logging
import re

from gateway.asgi import Scope, Send, send_whole
from gateway.config import UpstreamConfig
from gateway.errors import (
    REFUSED,
    KvgateError,
    MethodNotAllowed,
    NotFound,
    ReplicaRefused,
    UpstreamError,
    UpstreamTimeout,
    openai_shaped,
)
from gateway.pool import Pool, Pools
from gateway.replicas import Replica
from gateway.responses import ResponseStore
from gateway.tenancy.edge import TenantGate
from gateway.transport import TRANSPORT_ERRORS

__all__ = ["StoredResponses", "match_stored"]

log = logging.getLogger(__name__)

_PATH = re.compile(r"^/v1/responses/([A-Za-z0-9_.\-]{1,256})(/cancel)?$")


def match_stored(path: str) -> bool:
    return path.startswith("/v1/responses/")


class StoredResponses:
    def __init__(
        self, pools: Pools, gate: TenantGate, store: ResponseStore, up: UpstreamConfig
    ) -> None:
        self._pools = pools
        self._gate = gate
        self._store = store
        self._timeout = min(up.first_byte_timeout_s, up.total_timeout_s)

    async def handle(self, scope: Scope, send: Send, req_id: bytes, token: str | None) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        try:
            status, content_type, body, where = await self._forward(path, method, scope, token)
        except KvgateError as exc:
            await send_whole(send, exc.status, [*exc.headers(), (b"x-request-id", req_id)],
                             exc.body())
            return
        if status >= 400 and (shaped := openai_shaped(status, body)) is not None:
            body, content_type = shaped, "application/json"
        hdrs = [(b"content-type", content_type.encode("latin-1")), (b"x-request-id", req_id),
                (b"x-kvgate-replica", where.encode()), (b"x-kvgate-route", b"response-affinity")]
        await send_whole(send, status, hdrs, body)

    async def fetch(self, path: str, token: str | None) -> None:
        """Learn where the response `path` names lives when another gateway relayed it;
        only for a caller with a valid key (`locate` answers the others)."""
        m = _PATH.match(path)
        if m is None:
            return
        try:
            self._gate.principal(token)
        except KvgateError:
            return
        await self._store.fetch(m.group(1))

    def locate(
        self, path: str, method: str, token: str | None, *, head: bool = False
    ) -> tuple[Pool, Replica]:
        """The pool and replica holding the response `path` names, for the caller of `token`
        (401, 404, 405 as `KvgateError`s). The Envoy endpoint picker routes with it too
        (without `head`: Envoy would send a HEAD on to vLLM, which has no HEAD routes)."""
        principal = self._gate.principal(token)
        m = _PATH.match(path)
        if m is None:
            raise NotFound(f"Unknown path {path}.")
        cancel = m.group(2) is not None
        if method != ("POST" if cancel else "GET"):
            allowed = "POST" if cancel else "GET, HEAD" if head else "GET"
            raise MethodNotAllowed(f"Use {allowed} for {path}.", allow=allowed)
        rid = m.group(1)
        home = self._store.home(rid, principal.tenant_id)
        pool = self._pools.by_name.get(home.pool) if home is not None else None
        replica = pool.by_id.get(home.replica) if pool is not None and home is not None else None
        if pool is None or replica is None:
            raise NotFound(f"Response with id '{rid}' not found.", param="response_id")
        return pool, replica

    async def _forward(
        self, path: str, method: str, scope: Scope, token: str | None
    ) -> tuple[int, str, bytes, str]:
        await self.fetch(path, token)
        if method == "HEAD":  # GET without the body (the server leaves it out)
            method = "GET"
        pool, replica = self.locate(path, method, token, head=True)
        query = scope.get("query_string", b"")
        url = replica.url + path + (f"?{query.decode('latin-1')}" if query else "")
        headers = {k: v for k, v in pool.headers.items() if k != "Content-Type"}
        try:
            status, content_type, body = await pool.transport.call(
                method, url, self._timeout, headers)
        except TimeoutError:
            raise UpstreamTimeout("The replica did not answer in time.") from None
        except TRANSPORT_ERRORS:
            raise UpstreamError("The replica holding this response did not answer.") from None
        if status in REFUSED:  # kvgate's credentials, not the client's
            raise ReplicaRefused(status)
        return status, content_type, body, f"{pool.name}/{replica.id}"
