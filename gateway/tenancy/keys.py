"""Tenant API keys: generated here, shown once, stored only as a hash.

A key is ``kvg-`` + 32 random bytes in base64url (43 characters). Its stored form is an
unkeyed SHA-256 hex digest: with 256 bits of entropy a preimage search is hopeless, so a slow
password hash (bcrypt/argon2) would buy nothing and cost milliseconds on every cache miss; a
keyed hash would make the server secret necessary to verify keys. Key ids are separate random
handles (``key_`` + 12 hex) so operators can list and revoke keys without ever seeing them.
"""

from __future__ import annotations

import hashlib
import re
import secrets

__all__ = ["KEY_PREFIX", "generate_key", "hash_key", "hide_keys", "looks_like_key", "new_key_id"]

KEY_PREFIX = "kvg-"
_KEY_BYTES = 32
# a key's shape in free text: the prefix and what is left of its base64url body (a client may
# cut or pad it); 16 characters already leave nothing short enough to be another word
_KEY_IN_TEXT = re.compile(r"kvg-[A-Za-z0-9_-]{16,}")


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(_KEY_BYTES)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(6)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def looks_like_key(token: str) -> bool:
    """True when `token` has the shape of a tenant key (used to answer 403 on the admin API)."""
    return token.startswith(KEY_PREFIX)


def hide_keys(text: str) -> str:
    """`text` with whatever has a key's shape replaced by ``kvg-***``: a client's free text
    that reaches a log line (a key pasted as the `model`) never logs a key."""
    return _KEY_IN_TEXT.sub(KEY_PREFIX + "***", text) if KEY_PREFIX in text else text
