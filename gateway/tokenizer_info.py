"""vLLM's ``GET /tokenizer_info`` (the tokenizer's configuration, its chat template included),
asked of a replica of the pool the key's model is served from.

The proxied routes are POSTs with a JSON body naming the model; this one is a GET without a
body, so the model comes from the query (``?model=NAME``) or is the key's only model (as a
body without ``model``: `Planner.default_model`). The key is checked (401), the model must be
one the key's tier can use (404 listing them), and the least loaded usable replica of its pool
is asked (503 with Retry-After when none is); its answer is relayed whole, bounded as a stored
response's GET is (the first-byte then idle timeouts, all within the total one, and
``upstream.max_answer_bytes``). Nothing to retry, nothing counted against limits: the answer
is the same on every replica of the pool and costs it no compute. Behind Envoy the picker
answers it alike, itself (an immediate response: `TokenizerInfo.reply`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from urllib.parse import parse_qsl

from gateway.asgi import Scope, Send, send_whole
from gateway.config import UpstreamConfig
from gateway.errors import KvgateError, UpstreamError, UpstreamTimeout
from gateway.pool import Pool, Pools
from gateway.prepare import Preparer
from gateway.replicas import Replica
from gateway.request import scan_headers
from gateway.stored import NOT_IN_TIME
from gateway.transport import TRANSPORT_ERRORS
from gateway.upstream_errors import openai_shaped
from gateway.whole import fetch_whole

__all__ = ["TOKENIZER_INFO", "TokenizerInfo"]

TOKENIZER_INFO = "/tokenizer_info"
UNANSWERED = "The replica did not answer."


def _new_id() -> bytes:
    return os.urandom(12).hex().encode()


class TokenizerInfo:
    """Answers ``GET /tokenizer_info`` (module docstring)."""

    def __init__(self, prep: Preparer, pools: Pools, up: UpstreamConfig,
                 clock: Callable[[], float], replica_header: bool) -> None:
        self._prep, self._planner, self._pools = prep, prep.planner, pools
        self._up, self._clock, self._replica_header = up, clock, replica_header

    async def answer(self, scope: Scope, send: Send) -> None:
        head = scan_headers(scope["headers"], _new_id)
        await send_whole(send, *await self.reply(
            head.token, scope.get("query_string", b""), head.req_id, head.up_id))

    async def reply(self, token: str | None, query: bytes, req_id: bytes,
                    up_id: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The answer's status, headers and body (both edges: the picker answers it itself,
        `gateway.epp.request_side`); `req_id` the client's X-Request-Id, `up_id` the
        replica's."""
        try:
            pool, replica = self._where(token, query)
            status, body = await self._ask(pool, replica, up_id)
        except KvgateError as exc:
            return exc.status, [*exc.headers(), (b"x-request-id", req_id)], exc.body()
        headers = [(b"content-type", b"application/json"), (b"x-request-id", req_id)]
        if self._replica_header:
            headers.append((b"x-kvgate-replica", f"{pool.name}/{replica.id}".encode()))
        return status, headers, body

    def _where(self, token: str | None, query: bytes) -> tuple[Pool, Replica]:
        """The pool serving the asked model to the key's tier, and its least loaded usable
        replica."""
        principal = self._prep.authenticate(token)
        asked = dict(parse_qsl(query.decode("latin-1"))).get("model")
        model = asked or self._planner.default_model(principal)
        now = self._clock()
        name = (self._planner.pool_for(principal, model, now)
                if model in self._planner.offered(principal) else None)
        pool = self._pools.by_name.get(name) if name is not None else None
        if pool is None:
            raise self._planner.not_found(principal, model)
        usable = [r for r in pool.replicas if r.available(now)]
        if not usable:
            raise pool.none_healthy(model, now)
        return pool, min(usable, key=lambda r: r.inflight)

    async def _ask(self, pool: Pool, replica: Replica, up_id: bytes) -> tuple[int, bytes]:
        """The replica's status and JSON body (an error re-shaped into OpenAI's)."""
        headers = {k: v for k, v in pool.headers.items() if k != "Content-Type"}
        headers["X-Request-Id"] = up_id.decode("latin-1")
        up = self._up
        try:
            resp, body = await fetch_whole(
                pool.transport, replica.url + TOKENIZER_INFO, headers, "GET",
                head_s=min(up.first_byte_timeout_s, up.total_timeout_s),
                idle_s=up.idle_timeout_s, total_s=up.total_timeout_s,
                max_bytes=up.max_answer_bytes)
        except TimeoutError:
            raise UpstreamTimeout(NOT_IN_TIME) from None
        except TRANSPORT_ERRORS:
            raise UpstreamError(UNANSWERED) from None
        if resp.status >= 400 and (shaped := openai_shaped(resp.status, body)) is not None:
            body = shaped
        return resp.status, body
