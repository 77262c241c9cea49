"""Per-tenant `cache_salt`: a keyed derivation vLLM accepts (`gateway.body` puts it in the body).

salt = HMAC-SHA256(server secret, "kvgate-cache-salt" | subject | epoch), where the subject is
``tenant:<id>`` or ``group:<name>`` for tenants an operator put in a shared-salt group. Bumping
the epoch gives a new, unrelated salt, so the tenant stops hitting its old KV cache. Rendered
as hex (64 chars) or unpadded base64url (43 chars): both inside vLLM's rules (non-empty, at most
128 characters, never '@', '/', '\\' or NUL).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Literal

from gateway.tenancy.models import Tenant

__all__ = ["FRESH_EPOCH_MIN", "SaltDeriver", "SaltEncoding", "fresh_epoch"]

SaltEncoding = Literal["hex", "base64url"]
_CONTEXT = b"kvgate-cache-salt"
MIN_SECRET_BYTES = 16
FRESH_EPOCH_MIN = 2**40  # a fresh epoch: random in [2**40, 2**52), far past any counted one


def fresh_epoch() -> int:
    """An epoch no salt was derived from before (but by a chance of 2**-52): a salt group
    whose stored epoch is unreadable, and a tenant created through the admin API, start
    there (below 2**53: exact in JSON readers that use doubles)."""
    return FRESH_EPOCH_MIN + secrets.randbelow(2**52 - FRESH_EPOCH_MIN)


class SaltDeriver:
    """Holds the server secret; never prints it (repr, str and errors stay secret-free)."""

    __slots__ = ("_encoding", "_key")

    def __init__(self, secret: str | bytes, *, encoding: SaltEncoding = "base64url") -> None:
        key = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the salt secret must be at least {MIN_SECRET_BYTES} bytes")
        if encoding not in ("hex", "base64url"):
            raise ValueError("salt encoding must be 'hex' or 'base64url'")
        self._key = key
        self._encoding: SaltEncoding = encoding

    def __repr__(self) -> str:
        return f"SaltDeriver(encoding={self._encoding!r}, secret=<hidden>)"

    __str__ = __repr__

    def derive(self, subject: str, epoch: int) -> str:
        msg = b"\x00".join((_CONTEXT, subject.encode(), str(epoch).encode()))
        digest = hmac.new(self._key, msg, hashlib.sha256).digest()
        if self._encoding == "hex":
            return digest.hex()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def fingerprint(self) -> str:
        """What tells this secret and encoding from another (`secret_check`): 16 hex digits
        of an HMAC of a message no salt is derived from, so neither the secret nor a salt."""
        msg = b"\x00".join((b"kvgate-salt-secret-check", self._encoding.encode()))
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:16]

    def for_tenant(self, tenant: Tenant, group_epochs: Mapping[str, int]) -> str:
        """The tenant's salt: its group's (shared) when it has one, else its own."""
        if tenant.salt_group is not None:
            group = tenant.salt_group
            return self.derive(f"group:{group}", group_epochs.get(group, 0))
        return self.derive(f"tenant:{tenant.id}", tenant.salt_epoch)
