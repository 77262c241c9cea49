"""Admin authentication: bearer admin tokens, compared in constant time, never tenant keys.

Admin tokens must be at least `MIN_ADMIN_TOKEN_CHARS` characters and not of a tenant key's
form (checked when the configuration loads, so a short one stops `kvgate serve` before
anything listens). Refusals carry a `reason` for the guard (`gateway.admin.guard`) that
throttles, logs and counts them.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.asgi import Scope
from gateway.errors import AuthError, KvgateError, PermissionDenied
from gateway.policy_doc import NAME_PATTERN
from gateway.tenancy.keys import KEY_PREFIX, looks_like_key
from gateway.tenancy.resolver import parse_bearer

__all__ = [
    "ADMIN_MAX_BODY_BYTES", "MIN_ADMIN_TOKEN_CHARS", "AdminToken",
    "admin_authorized", "admin_body_limit", "admin_tokens_from_env", "check_admin",
    "header_safe", "one_authorization",
]

MIN_ADMIN_TOKEN_CHARS = 16
# The admin API's body bound for callers with a valid admin token (an anonymous caller's body
# is never read: `admin_authorized`). A policy document is a few KiB; route explain of a
# request with a long prompt takes up to the proxy's own limit (`admin_body_limit`).
ADMIN_MAX_BODY_BYTES = 1024 * 1024
EXPLAIN_PATH = "/admin/route/explain"


@dataclass(frozen=True, slots=True)
class AdminToken:
    """An admin token and the id the audit log records for it (the token is never shown)."""

    id: str
    token: str = field(repr=False)


def admin_tokens_from_env(value: str | None) -> list[AdminToken]:
    """Parse ``KVGATE_ADMIN_TOKEN``: a bare token (id ``admin``) or ``id:token,id:token``.

    `ValueError` (naming the token's id, never the token) for a malformed value, a token
    shorter than `MIN_ADMIN_TOKEN_CHARS` or of a tenant key's form (``kvg-...``: one copied
    from a tenant's key opened the admin API to that tenant), or an id given twice (the
    audit log names the writer by its token's id: two tokens under one id could not be told
    apart). A token never holds ``:`` (`_pair`)."""
    if not value or not value.strip():
        return []
    entries = [part.strip() for part in value.split(",") if part.strip()]
    if len(entries) == 1 and ":" not in entries[0]:
        tokens = [AdminToken("admin", entries[0])]
    else:
        tokens = []
        for entry in entries:
            ident, token = _pair(entry, alone=len(entries) == 1)
            if any(t.id == ident for t in tokens):
                raise ValueError(f"KVGATE_ADMIN_TOKEN: the id {ident[:64]!r} is given twice; "
                                 "each admin token needs its own id (the audit log names it)")
            tokens.append(AdminToken(ident, token))
    for admin in tokens:
        # a lone value's id is not shown: it may be the first part of a token with a ':'
        which = f"the admin token with id {admin.id!r}" if len(entries) > 1 else "the admin token"
        if looks_like_key(admin.token):  # a tenant's key (its holder would be an admin)
            raise ValueError(
                f"KVGATE_ADMIN_TOKEN: {which} has the form of a "
                f"tenant API key ({KEY_PREFIX}...); an admin token must be none of them "
                "(e.g. `openssl rand -hex 24`)")
        if not header_safe(admin.token):
            # the gateway started, and every admin call was a 401 (curl sends its UTF-8 bytes)
            # or a client error (`kvgate admin`: a traceback)
            raise ValueError(
                f"KVGATE_ADMIN_TOKEN: {which} holds a space, a control or a non-ASCII "
                "character: no client can send it in an Authorization header; use one "
                "without (e.g. `openssl rand -hex 24`)")
        if len(admin.token) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(
                f"KVGATE_ADMIN_TOKEN: {which} has {len(admin.token)} "
                f"characters; admin tokens need at least {MIN_ADMIN_TOKEN_CHARS} "
                "(e.g. `openssl rand -hex 24`)"
            )
    return tokens


def header_safe(token: str) -> bool:
    """A token an ``Authorization: Bearer`` header can carry, as sent and as read back: printable
    ASCII without blanks."""
    return token.isascii() and token.isprintable() and not any(c.isspace() for c in token)


# The id of a lone ``id:token``, named as a tenant is (`policy_doc.NAME_PATTERN`): a lone
# value with a ':' is a pair only when what precedes it is such a name.
_LONE_ID = re.compile(NAME_PATTERN)
_NO_COLON = ("KVGATE_ADMIN_TOKEN: {what}; an admin token cannot contain ':' (it separates an "
             "id from its token: 'id:token,id:token'); use one without it (e.g. `openssl "
             "rand -hex 24`)")


def _pair(entry: str, *, alone: bool) -> tuple[str, str]:
    """One ``id:token`` entry. A bare token holding ``:`` was read as ``id:token``: part of
    the secret became the id the audit log shows, and the token its rest (the whole value a
    401). Refused at start without showing either part: a token with a ':' after its id,
    and a lone value whose part before the ':' is not a name."""
    # blanks around the ':' are not the id's nor the token's: a client cannot send a
    # token's leading blank (a header value's are dropped), so ``ops: <token>`` made
    # a token no request could present, 401 for every one of its holders
    ident, sep, token = (part.strip() for part in entry.partition(":"))
    if not sep or not ident or not token:
        raise ValueError("KVGATE_ADMIN_TOKEN: expected a token or 'id:token,id:token'")
    if alone and not _LONE_ID.match(ident):
        raise ValueError(_NO_COLON.format(
            what="its value has a ':' and what precedes it is no id (letters, digits, '.', "
                 "'_', '-')"))
    if ":" in token:
        raise ValueError(_NO_COLON.format(what="a token holds a ':' after its id's"))
    return ident, token


def one_authorization(values: Sequence[str]) -> str | None:
    """The one ``Authorization`` value of an admin request (None without one). Two that
    differ are a 401, as for a tenant's key (`gateway.apikey`): which one a proxy in front
    checked cannot be known, and kvgate read the first (an invalid token first was refused,
    a valid one first let the request in whatever came after it)."""
    if any(value != values[0] for value in values[1:]):
        raise AuthError("two Authorization headers with different values: send one",
                        reason="invalid")
    return values[0] if values else None


def check_admin(tokens: Sequence[AdminToken], authorization: str | None) -> str:
    """The id of the admin token in an Authorization header value, or raise 401/403."""
    if not tokens:
        raise PermissionDenied(
            "the admin API is disabled: no admin token is configured (set KVGATE_ADMIN_TOKEN "
            "on the gateway, e.g. to `openssl rand -hex 24`, and restart it)", reason="disabled"
        )
    presented = parse_bearer(authorization)
    if presented is None:
        raise AuthError(
            "missing admin token: send 'Authorization: Bearer <admin token>'", reason="missing"
        )
    found: str | None = None
    given = presented.encode()
    for candidate in tokens:  # no early exit: every token is compared, in constant time
        if hmac.compare_digest(candidate.token.encode(), given):
            found = candidate.id
    if found is not None:
        return found
    if looks_like_key(presented):
        raise PermissionDenied("tenant API keys cannot use the admin API", reason="tenant_key")
    raise AuthError("invalid admin token", reason="invalid")


def admin_authorized(tokens: Sequence[AdminToken]) -> Callable[[Scope], bool]:
    """Whether an ASGI request carries a valid admin token, read before its body
    (`gateway.jsondepth.guard_json_depth` leaves the body of one that does not unread: the
    admin app refuses it at once, and an anonymous upload is never buffered)."""

    def authorized(scope: Scope) -> bool:
        values = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
        try:
            check_admin(tokens, one_authorization(values))
        except KvgateError:
            return False
        return True

    return authorized


def admin_body_limit(max_body: int) -> Callable[[Scope], int]:
    """The admin API's body bound for one (authorized) request: `ADMIN_MAX_BODY_BYTES`, but
    the proxy's own `max_body` for route explain (explaining a request with a long prompt is
    legitimate)."""
    small = min(ADMIN_MAX_BODY_BYTES, max_body)
    return lambda scope: max_body if scope["path"] == EXPLAIN_PATH else small
