"""CORS on the public HTTP edge (`server.cors_*`), so a browser client works as against vLLM.

vLLM's OpenAI server answers CORS by default; kvgate does too. Preflights (``OPTIONS`` with
``Origin`` and ``Access-Control-Request-Method``) are answered here, before any key check,
limit or replica (`GatewayApp._http`). An actual answer to an allowed ``Origin`` carries
``Access-Control-Allow-Origin`` and ``Access-Control-Expose-Headers``: on the proxied routes
the headers join the answer's head (`ProxiedRequest.cors`, found by the header scan the route
does anyway: nothing per stream chunk); on kvgate's own pages `wrap` adds them to the one
``http.response.start``. A request without ``Origin``, or from an origin not allowed, gets no
CORS header and is served as any other (CORS is not authentication). No credentials mode:
kvgate authenticates by bearer token, which a browser never sends on its own, so ``*`` is safe
enough as the default. The admin API and the admin port never answer CORS.
"""

from __future__ import annotations

from gateway.asgi import Headers, Message, Send
from gateway.config import ServerConfig

__all__ = ["EXPOSED", "Cors", "origin_of"]

# the headers OpenAI clients (and kvgate's tools) read, beyond the CORS-safelisted ones
EXPOSED = (
    "x-request-id", "retry-after",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
)
VARY_ORIGIN = (b"vary", b"origin")


class Cors:
    """The CORS answers of one configuration (`from_config`: None when CORS is off)."""

    def __init__(self, server: ServerConfig) -> None:
        origins = server.cors_allowed_origins
        self.any_origin = "*" in origins
        self.origins = frozenset(o.encode("latin-1") for o in origins)
        exposed = [*EXPOSED]
        if server.replica_header:
            exposed.append("x-kvgate-replica")
        if server.route_header:
            exposed.append("x-kvgate-route")
        self._expose = (b"access-control-expose-headers", ", ".join(exposed).encode())
        self._any: Headers = [(b"access-control-allow-origin", b"*"), self._expose]
        methods = server.cors_allowed_methods
        self._methods = None if "*" in methods else ", ".join(methods).encode()
        headers = server.cors_allowed_headers
        self._headers = None if "*" in headers else ", ".join(headers).encode()
        self._max_age = str(server.cors_max_age_s).encode()

    @classmethod
    def from_config(cls, server: ServerConfig) -> Cors | None:
        return cls(server) if server.cors_allowed_origins else None

    def allowed(self, origin: bytes | None) -> Headers | None:
        """The headers of an actual answer to a request from `origin` (None: none to add)."""
        if origin is None:
            return None
        if self.any_origin:
            return self._any
        if origin in self.origins:
            return [(b"access-control-allow-origin", origin), VARY_ORIGIN, self._expose]
        return None

    def preflight(self, headers: Headers) -> Headers | None:
        """The answer's headers when `headers` are an allowed origin's preflight, else None."""
        origin = method = asked = None
        for key, value in headers:
            if key == b"origin":
                origin = value
            elif key == b"access-control-request-method":
                method = value
            elif key == b"access-control-request-headers":
                asked = value
        if origin is None or method is None:
            return None  # not a preflight: an OPTIONS request as any other
        if not self.any_origin and origin not in self.origins:
            return None
        out: Headers = [(b"access-control-allow-origin", b"*" if self.any_origin else origin)]
        vary = [] if self.any_origin else [b"origin"]
        # "*" in a list: echo what the browser asked for (right with or without credentials)
        if self._methods is None:
            out.append((b"access-control-allow-methods", method))
            vary.append(b"access-control-request-method")
        else:
            out.append((b"access-control-allow-methods", self._methods))
        if self._headers is None:
            if asked:
                out.append((b"access-control-allow-headers", asked))
            vary.append(b"access-control-request-headers")
        else:
            out.append((b"access-control-allow-headers", self._headers))
        out.append((b"access-control-max-age", self._max_age))
        if vary:
            out.append((b"vary", b", ".join(vary)))
        return out

    @staticmethod
    def wrap(send: Send, extra: Headers) -> Send:
        """`send` with `extra` added to the answer's head (kvgate's own pages, not the proxied
        routes' streams)."""
        async def cors_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)
        return cors_send


def origin_of(headers: Headers) -> bytes | None:
    for key, value in headers:
        if key == b"origin":
            return value
    return None
