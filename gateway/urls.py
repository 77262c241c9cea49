"""How a replica URL is shown: without the credentials it may carry.

A replica URL may hold userinfo (``http://user:password@host:port``, e.g. for a proxy in front
of vLLM). Anything that shows or logs a URL -- the admin API, `kvgate config check`, a 400
naming a bad URL, the policy document `GET /admin/policy` answers -- shows `shown_url(url)`:
the userinfo (user name too: some services take a token as the user name) becomes ``***``.
The URL itself is kept as given for the connections, and a policy document sent back with a
URL shown so gets the stored URL's credentials back (`restore_hidden`).
"""

from __future__ import annotations

import ipaddress
from typing import Any

__all__ = ["is_ip", "restore_hidden", "shown_policy", "shown_url"]

_HIDDEN = "***"


def is_ip(host: str) -> bool:
    """Whether `host` is an IP address (v4 or v6), not a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def shown_url(url: str) -> str:
    """`url` with its userinfo, if any, replaced by ``***`` (anything else left as it is).
    Split by hand, not with urllib: a URL urllib refuses (a bad port) is hidden all the same.
    The authority is taken to end at the first ``/`` only: a password holding a raw ``?`` or
    ``#`` (urllib ends the authority there and reads the password as a port) is hidden too,
    at the cost of hiding an ``@`` in a query of a URL without a path."""
    if "@" not in url:  # the common case
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    cut = rest.find("/") if "/" in rest else len(rest)
    authority, tail = rest[:cut], rest[cut:]
    if "@" not in authority:
        return url  # an @ in the path or query, not credentials
    return f"{scheme}{sep}{_HIDDEN}@{authority.rpartition('@')[2]}{tail}"


def shown_policy(doc: dict[str, Any]) -> dict[str, Any]:
    """A policy document (as JSON data) with each pool's replica URLs shown (`shown_url`);
    the document itself is not changed."""
    pools = doc.get("pools")
    if not isinstance(pools, dict):
        return doc
    shown = {}
    for name, pool in pools.items():
        urls = pool.get("replicas") if isinstance(pool, dict) else None
        if isinstance(urls, list) and any(isinstance(u, str) and "@" in u for u in urls):
            pool = {**pool, "replicas": [shown_url(u) if isinstance(u, str) else u
                                         for u in urls]}
        shown[name] = pool
    return {**doc, "pools": shown}


def restore_hidden(doc: Any, stored: dict[str, Any] | None) -> str | None:
    """Put back, in a policy document sent to kvgate (as JSON data, changed in place), the
    credentials of each replica URL it shows hidden (``***@``, as `shown_policy` answered it)
    from the `stored` document's URL shown the same way: a document read, edited and sent
    back keeps its replicas reachable. Returns a hidden URL no stored one matches, if any."""
    pools = doc.get("pools") if isinstance(doc, dict) else None
    if not isinstance(pools, dict):
        return None
    known = {shown_url(url): url for pool in ((stored or {}).get("pools") or {}).values()
             for url in pool.get("replicas") or ()}
    for pool in pools.values():
        replicas = pool.get("replicas") if isinstance(pool, dict) else None
        if not isinstance(replicas, list):
            continue
        for i, url in enumerate(replicas):
            if isinstance(url, str) and f"{_HIDDEN}@" in url:
                if url not in known:
                    return url
                replicas[i] = known[url]
    return None
