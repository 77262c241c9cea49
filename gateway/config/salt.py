"""The server secret that cache salts are derived from: where it comes from
(``KVGATE_SALT_SECRET`` or `tenancy.salt_secret_file`), and whether authentication has one."""

from __future__ import annotations

import secrets
from pathlib import Path

from gateway.config.model import KvgateConfig
from gateway.errors import ConfigError

__all__ = ["MIN_SECRET_CHARS", "auth_secret", "salt_secret"]

MIN_SECRET_CHARS = 16  # the salt derivation's minimum key length (gateway.tenancy.salts)


def salt_secret(cfg: KvgateConfig) -> str | None:
    """The server secret for cache salts: ``KVGATE_SALT_SECRET`` or `tenancy.salt_secret_file`.
    Both set must agree: the variable won silently, so a rotated (or unreadable) file was
    ignored while the old secret stayed in use."""
    env = cfg.salt_secret.get_secret_value() if cfg.salt_secret is not None else None
    path = cfg.tenancy.salt_secret_file
    if not path:
        return env
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"tenancy.salt_secret_file: cannot read it ({exc.strerror})") from None
    secret = lines[0].strip() if lines else ""
    if not secret:  # else "no salt secret is configured: set ... tenancy.salt_secret_file"
        raise ConfigError(f"tenancy.salt_secret_file: {path}: its first line, the secret, "
                          "is empty")
    if env is not None and secret != env:
        raise ConfigError("tenancy.salt_secret_file: KVGATE_SALT_SECRET is set too and differs "
                          "from the file's first line: keep one of the two")
    return secret if env is None else env


def auth_secret(cfg: KvgateConfig) -> tuple[str, bool]:
    """(salt secret, salts on?) for this config; `ConfigError` when auth lacks a secret.

    With `tenancy.auth` (the default) a secret is required. Without auth (`--no-auth`) a
    configured secret still salts the one tenant's requests; without one, a random secret
    keeps the machinery uniform and no `cache_salt` is sent (one tenant: nothing to isolate).
    """
    secret = salt_secret(cfg)
    if secret is not None and len(secret.encode()) < MIN_SECRET_CHARS:
        # how to make one, as the admin token's message says: a user who typed a word
        # had to look up what "bytes" of a secret wants
        make = (f"; it has {len(secret.encode())}: make one with `openssl rand -hex 32`")
        if cfg.salt_secret is None:  # from the file: the variable is not set
            raise ConfigError("tenancy.salt_secret_file: the secret (its first line) must be "
                              f"at least {MIN_SECRET_CHARS} bytes{make}")
        raise ConfigError(
            f"salt_secret: KVGATE_SALT_SECRET must be at least {MIN_SECRET_CHARS} bytes{make}"
        )
    if secret is not None:
        return secret, True
    if cfg.tenancy.auth:
        raise ConfigError(
            "authentication is on but no salt secret is configured: set KVGATE_SALT_SECRET "
            f"(at least {MIN_SECRET_CHARS} random bytes) or tenancy.salt_secret_file, or run "
            "with --no-auth for local single-tenant use"  # serve's and epp's flag alike
        )
    return secrets.token_urlsafe(32), False
