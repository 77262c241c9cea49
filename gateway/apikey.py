"""The API key a request presents, as both edges and `/v1/models` read it.

OpenAI's SDKs send ``Authorization: Bearer <key>``; Azure OpenAI's send the bare key in
``api-key``, and clients written for other providers in ``x-api-key``. kvgate reads all three, so
such a client authenticates instead of getting a 401 that blames a key it did send (the key
never goes further: kvgate sends replicas its own credentials, not the client's headers).
``Authorization`` wins over the other two (a client may carry another provider's key in
``x-api-key`` beside kvgate's bearer). Two ``Authorization`` headers with different keys (or
``api-key`` and ``x-api-key`` that disagree, without one) are `CONFLICTING`: which one a proxy
in front of kvgate checked is unknowable (vLLM reads the first ``Authorization``, many proxies
the last), so the request is refused (401 saying so; `TenantResolver.authenticate`) rather than
served under one of them.
"""

from __future__ import annotations

from gateway.tenancy.resolver import CONFLICTING_KEYS as CONFLICTING
from gateway.tenancy.resolver import parse_bearer

__all__ = ["BARE_KEY_HEADERS", "CONFLICTING", "KEY_HEADERS", "KeyScan", "bare_key", "merge"]

# the request headers that carry a key (ASGI header names are lower-case bytes)
BARE_KEY_HEADERS = frozenset({b"api-key", b"x-api-key"})
KEY_HEADERS = BARE_KEY_HEADERS | {b"authorization"}


class KeyScan:
    """Feed it each key header (`KEY_HEADERS`) of a request; `key` is the one presented."""

    __slots__ = ("_bare", "_bearer")

    def __init__(self) -> None:
        self._bearer: str | None = None  # from Authorization
        self._bare: str | None = None  # from api-key / x-api-key

    def add(self, name: bytes, value: bytes) -> None:
        if name == b"authorization":  # another scheme (Basic ...) holds no key for kvgate
            self._bearer = merge(self._bearer, parse_bearer(value.decode("latin-1")))
        else:
            self._bare = merge(self._bare, bare_key(value))

    @property
    def key(self) -> str | None:
        return self._bearer if self._bearer is not None else self._bare


def bare_key(value: bytes) -> str | None:
    """The key of an ``api-key`` / ``x-api-key`` header value (the bare key)."""
    return value.decode("latin-1").strip() or None


def merge(current: str | None, key: str | None) -> str | None:
    """The key of one kind of header so far, with one more header's (None: it held none)."""
    if key is None or current == key:
        return current
    return key if current is None else CONFLICTING
