"""The API key a request presents, as both edges and `/v1/models` read it.

OpenAI's SDKs send ``Authorization: Bearer <key>``; Azure OpenAI's send the bare key in
``api-key``, and clients written for other providers in ``x-api-key``. kvgate reads all three, so
such a client authenticates instead of getting a 401 that blames a key it did send (the key
never goes further: kvgate sends replicas its own credentials, not the client's headers).
Keys that disagree -- two ``Authorization`` headers with different keys, or an ``api-key``
other than the bearer token -- are `CONFLICTING`: which one a proxy in front of kvgate checked
is unknowable (vLLM reads the first ``Authorization``, many proxies the last), so the request
is refused (401 saying so; `TenantResolver.authenticate`) rather than served under one of them.
"""

from __future__ import annotations

from gateway.tenancy.resolver import CONFLICTING_KEYS as CONFLICTING
from gateway.tenancy.resolver import parse_bearer

__all__ = ["CONFLICTING", "KEY_HEADERS", "merge_key"]

# the request headers that carry a key (ASGI header names are lower-case bytes)
KEY_HEADERS = frozenset({b"authorization", b"api-key", b"x-api-key"})


def merge_key(current: str | None, name: bytes, value: bytes) -> str | None:
    """The key so far (`current`), with one more key header: unchanged by a header that holds
    none (an ``Authorization`` with another scheme, an empty value), `CONFLICTING` once two
    disagree."""
    text = value.decode("latin-1")
    key = parse_bearer(text) if name == b"authorization" else (text.strip() or None)
    if key is None or current == key:
        return current
    return key if current is None else CONFLICTING
