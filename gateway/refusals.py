"""The HTTP guard's own answers (`gateway.httpguard`): a refusal in OpenAI's error shape
(Anthropic's on `/v1/messages` and count_tokens, once the request line was read) with its
status (400, 408, 431, 501, 505), a ``Date``, the CORS headers the app would give the
request's ``Origin`` and ``x-should-retry: false`` where the SDKs would retry in vain; an
HTTP/2 client with prior knowledge is told in HTTP/2 (GOAWAY ``HTTP_1_1_REQUIRED``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from gateway import anthropic_errors
from gateway.edge_answers import Header, date_header
from gateway.errors import error_body, for_status
from gateway.guard_api import REFUSED
from gateway.pipelining import PipelinedAnswers

__all__ = ["H2_REFUSAL", "Refusals"]

_KINDS = {400: "BadRequestError", 408: "RequestTimeoutError",
          431: "RequestHeaderFieldsTooLargeError", 501: "NotImplementedError",
          505: "HTTPVersionNotSupportedError"}
# what the SDKs would retry in vain
_UNRETRIED = {501: [(b"x-should-retry", b"false")], 505: [(b"x-should-retry", b"false")]}
H2_GOAWAY_DEBUG = b"This server speaks HTTP/1.1 only; send the request without HTTP/2."
# RFC 9113 4.1 frames: the server's preface (an empty SETTINGS), then GOAWAY (type 7) with last
# stream 0 (no stream was processed) and error HTTP_1_1_REQUIRED (0xd), its debug data a text
H2_REFUSAL = (b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
              + (8 + len(H2_GOAWAY_DEBUG)).to_bytes(3, "big") + b"\x07\x00\x00\x00\x00\x00"
              + (0).to_bytes(4, "big") + (0xD).to_bytes(4, "big") + H2_GOAWAY_DEBUG)


class Refusals(PipelinedAnswers):
    """Answers a refused request itself, then closes (module docstring)."""

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with an OpenAI-shaped error, then close the connection
        (`_answer_and_close`)."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            scope = cast(dict[str, Any], cycle.scope)  # its body was due: the app runs it
            scope.setdefault("extensions", {})[REFUSED] = status
        body = self._refusal_body(status, message)
        extra = b"".join(k + b": " + v + b"\r\n" for k, v in [
            *date_header(), *self._cors(), *_UNRETRIED.get(status, ())])
        self._answer_and_close(b"".join([
            STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\n", b"connection: close\r\n",
            extra, b"\r\n", body,
        ]))
        self.logger.info("request refused: %s", message)

    def _refusal_body(self, status: int, message: str) -> bytes:
        """OpenAI's error shape, Anthropic's on its routes (`gateway.anthropic_errors`) when
        the refused request's target is known: its SDK reads the type and message there."""
        url = getattr(self, "url", b"")  # uvicorn's: the request line's target, as parsed
        if isinstance(url, bytes) and url:
            # runs of slashes and a trailing one read as `gateway.paths.canonical` reads them
            # (not imported: `paths` imports the app, which imports this guard)
            target = url.partition(b"?")[0].decode("latin-1")
            path = "/" + "/".join(part for part in target.split("/") if part)
            if path in anthropic_errors.ANTHROPIC_PATHS:
                return anthropic_errors.error_body(path, for_status(status, message))
        return error_body(message, _KINDS[status], status)

    def _refuse_http2(self) -> None:
        """Tell an HTTP/2 client with prior knowledge, in HTTP/2, to use HTTP/1.1."""
        self._answer_and_close(H2_REFUSAL)
        self.logger.info("request refused: HTTP/2 with prior knowledge (answered GOAWAY "
                         "HTTP_1_1_REQUIRED)")

    def _cors(self) -> list[Header]:
        """The CORS headers for the refused request's ``Origin``, asked of the app served
        (`GatewayApp.refusal_cors`: its `server.cors_*`, none on the admin port)."""
        origin = self._origin
        find: Callable[[bytes, int | None], list[Header] | None] | None = getattr(
            self.config.app, "refusal_cors", None)
        if origin is None or find is None:
            return []
        local = self.server
        return find(origin, local[1] if local else None) or []
