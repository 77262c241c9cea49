"""What a replica URL must be for kvgate to reach it: checked on input (the configuration
file, `PUT`/`PATCH /admin/policy`), as `policy_doc.check_replicas_distinct` is.

The model's own check (`PoolConfig`) takes any URL urllib can split into a scheme, a host and
a port. Past that, a URL kvgate could not use was stored and the replica never served:

- a query or fragment (``http://h:8000?x=1``): kvgate appends ``/health``, ``/metrics`` and
  ``/v1/...`` to the URL, so each went into the query and vLLM answered 404 to all of them;
- port 0 (``http://h:0``): no server listens there, and its id read ``h:80``;
- a host no resolver takes (a label over 63 characters, a name over 253, a space or a
  control character): the health checks' task ended on the resolver's ``UnicodeError`` (no
  replica of any pool was checked again) and each request got a text/plain 500.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from gateway.urls import is_ip

__all__ = ["url_problem"]

# a host name's labels as resolvers take them (RFC 1123, with '_' that some DNS zones use)
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_NAME_MAX = 253
_SPACE_OR_CONTROL = re.compile(r"[\x00-\x20\x7f]")


def url_problem(url: str) -> str | None:
    """Why kvgate could not use `url` (one `PoolConfig` took: scheme, host and port split),
    or None when it can."""
    if _SPACE_OR_CONTROL.search(url):
        return "a replica URL holds no space or control character"
    if "?" in url or "#" in url:
        return ("a replica URL has no query or fragment ('?', '#'; a password's percent-"
                "encoded): kvgate appends /health, /metrics and /v1/... to it")
    parts = urlsplit(url)
    if parts.port == 0:
        return "a replica URL's port is 1 to 65535"
    host = parts.hostname or ""
    return None if is_ip(host) or _is_name(host) else f"{host!r} is not a host name"


def _is_name(host: str) -> bool:
    """Whether a resolver takes `host` (non-ASCII ones as their IDNA form)."""
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError:  # an empty label, one over 63 characters
        return False
    labels = ascii_host.removesuffix(".").split(".")
    return len(ascii_host) <= _NAME_MAX and all(_LABEL.fullmatch(label) for label in labels)
