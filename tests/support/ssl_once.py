"""One default TLS context per test process, shared by every httpx client it builds.

`httpx.get(...)` builds a client, and each client built with the default `verify=True` loaded
the CA bundle again: about 30 ms of CPU per call, so a test polling a gateway with
`httpx.get` every 50 ms spent more than half a core on it, beside the processes it tests on a
small machine (and every `openai.OpenAI(...)` a test builds paid it once more). The context
httpx builds for `verify=True` is the same each time (the CA bundle, or the SSL_CERT_FILE /
SSL_CERT_DIR it names, read when it is asked for); httpx takes one context for many clients
(`verify=<SSLContext>`). Anything else (`verify=False`, a context or file of the test's own,
a client certificate) is built as before. Only this process: the gateways and replicas a test
starts build their own.
"""

from __future__ import annotations

import importlib
import os
import ssl
from collections.abc import Callable
from typing import Any

__all__ = ["share_default_context"]

# httpx, and the fork the openai and anthropic clients build on: their transports call their
# package's `create_ssl_context` by this name
PACKAGES = ("httpx", "httpx2")


def _once(create: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    built: dict[tuple[str | None, str | None], ssl.SSLContext] = {}

    def shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None or not trust_env:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in built:
            built[key] = create(verify=verify, cert=cert, trust_env=trust_env)
        return built[key]

    shared.__wrapped__ = create  # type: ignore[attr-defined]
    return shared


def share_default_context() -> None:
    """Have the transports `httpx.Client`, `httpx.get` and the openai and anthropic clients
    build share one context per package for the default verification (again: no change)."""
    for package in PACKAGES:
        try:
            transports = importlib.import_module(f"{package}._transports.default")
        except ImportError:
            continue
        create = getattr(transports, "create_ssl_context", None)
        if create is not None and not hasattr(create, "__wrapped__"):
            setattr(transports, "create_ssl_context", _once(create))  # noqa: B010
