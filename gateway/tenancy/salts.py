"""Per-tenant `cache_salt`: a keyed derivation vLLM accepts, and the request-body rewrite.

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
from collections.abc import Mapping
from typing import Any, Literal

from gateway.tenancy.errors import InvalidRequest
from gateway.tenancy.models import Tenant

__all__ = [
    "OPERATOR_FIELDS", "ClientPriorityMode", "ClientSaltMode", "SaltDeriver", "SaltEncoding",
    "drop_operator_fields", "rewrite_body",
]

SaltEncoding = Literal["hex", "base64url"]
ClientSaltMode = Literal["strip", "reject"]
ClientPriorityMode = Literal["drop", "keep"]
_CONTEXT = b"kvgate-cache-salt"
# vLLM body fields meant for the operator: its internal request id, the KV-transfer handshake
# of disaggregated prefill, and free-form engine arguments. No tenant may set them unless its
# tier says `operator_fields: true`.
OPERATOR_FIELDS = ("request_id", "kv_transfer_params", "vllm_xargs")
MIN_SECRET_BYTES = 16


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

    def for_tenant(self, tenant: Tenant, group_epochs: Mapping[str, int]) -> str:
        """The tenant's salt: its group's (shared) when it has one, else its own."""
        if tenant.salt_group is not None:
            group = tenant.salt_group
            return self.derive(f"group:{group}", group_epochs.get(group, 0))
        return self.derive(f"tenant:{tenant.id}", tenant.salt_epoch)


def rewrite_body(
    body: dict[str, Any],
    *,
    cache_salt: str | None,
    served_model: str | None = None,
    priority: int | None = None,
    client_salt: ClientSaltMode = "strip",
    client_priority: ClientPriorityMode = "drop",
) -> None:
    """Rewrite an already-parsed request body in place for the upstream pool.

    A client's `cache_salt` is dropped (or rejected with 400) so no tenant can pick another
    tenant's salt; the client's `priority` is dropped (vLLM rejects non-zero priority on pools
    without priority scheduling, and tiers, not clients, decide it) unless `client_priority`
    is "keep" (the single-tenant `--no-auth` mode, where the caller owns the replicas). A
    tier's `priority` always wins.
    """
    if "cache_salt" in body:
        if client_salt == "reject":
            raise InvalidRequest(
                "cache_salt is set by the gateway and must not be sent", param="cache_salt"
            )
        del body["cache_salt"]
    if client_priority == "drop":
        body.pop("priority", None)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if served_model is not None:
        body["model"] = served_model
    if priority is not None:
        body["priority"] = priority


def drop_operator_fields(body: dict[str, Any]) -> None:
    """Remove vLLM's operator-only fields (`OPERATOR_FIELDS`) from a parsed body, in place."""
    for name in OPERATOR_FIELDS:
        body.pop(name, None)
