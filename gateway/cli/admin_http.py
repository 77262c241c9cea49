"""What the admin API's command-line clients (`kvgate admin`, `kvgate doctor`) share: the
token to send, read from ``KVGATE_ADMIN_TOKEN`` as the gateway reads it, and the hints for an
admin path the port does not serve, for a URL nothing answers at and for a ``--url`` with the
OpenAI base URL's ``/v1`` or the admin API's ``/admin``."""

from __future__ import annotations

from gateway.admin.auth import admin_tokens_from_env, header_safe

__all__ = ["NOT_ADMIN_PORT", "NOT_KVGATE", "NOT_LISTENING", "TOKEN_HELP", "client_token",
           "not_admin_port", "url_path_hint"]

TOKEN_HELP = ("the gateway's multi-token form 'id:token,id:token' sends the first token; "
              "a bare token is sent as it is")
NOT_ADMIN_PORT = ("The admin API is not on this port: point --url at the gateway's admin port "
                  "(server.admin_port).")
# where the admin API is, for a --url that reached something else
NOT_KVGATE = ("--url takes the gateway's port (its admin port when server.admin_port is set; "
              "`kvgate epp`: its --http-port)")
# after a connection that could not be made: the OS error alone said nothing to do
NOT_LISTENING = f"is kvgate running there? {NOT_KVGATE}"


def client_token(value: str) -> str:
    """The token to send for a ``KVGATE_ADMIN_TOKEN`` value: a bare token as it is (the
    gateway judges it), the first token of the ``id:token,id:token`` form (`ValueError` for a
    malformed or short one, as the gateway would refuse it at start)."""
    value = value.strip()
    if "," not in value and ":" not in value:
        if value and not header_safe(value):  # httpx raised: a traceback
            raise ValueError("KVGATE_ADMIN_TOKEN: the admin token holds a space, a control or "
                             "a non-ASCII character: an HTTP header cannot carry it")
        return value
    tokens = admin_tokens_from_env(value)
    return tokens[0].token if tokens else ""


def not_admin_port(status: int, message: str | None) -> bool:
    """True for the gateway's 404 of an /admin path on a port that does not serve the admin
    API (its public port while `server.admin_port` is set): the admin API's own 404s (an
    unknown tenant) name what is missing, not the path."""
    return status == 404 and (message or "").startswith("Unknown path /admin")


def url_path_hint(url: str) -> str | None:
    """What to say of a ``--url`` ending in ``/v1`` (the gateway's OpenAI base URL, the one
    every client snippet has) or ``/admin`` (the prefix the clients add to each call), or None:
    the admin API is at the gateway's address, and those gave a 404 that said nothing of
    --url ("Unknown path /v1/admin/tenants: kvgate serves /v1/chat/completions, ...")."""
    root = url.rstrip("/")
    if root.endswith("/v1"):
        why = "not under /v1 (the OpenAI base URL)"
    elif root.endswith("/admin"):
        why = "without /admin (added to each call)"
    else:
        return None
    return (f"--url {url}: the admin API is at the gateway's address, {why}: use --url "
            f"{root.rsplit('/', 1)[0]}")
