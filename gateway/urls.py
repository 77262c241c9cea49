"""How a replica URL is shown: without the credentials it may carry.

A replica URL may hold userinfo (``http://user:password@host:port``, e.g. for a proxy in front
of vLLM). Anything that shows or logs a URL -- the admin API, `kvgate config check`, a 400
naming a bad URL -- shows `shown_url(url)`: the userinfo (user name too: some services take a
token as the user name) becomes ``***``. The URL itself is kept as given for the connections.
"""

from __future__ import annotations

__all__ = ["shown_url"]

_HIDDEN = "***"


def shown_url(url: str) -> str:
    """`url` with its userinfo, if any, replaced by ``***`` (anything else left as it is).
    Split by hand, not with urllib: a URL urllib refuses (a bad port) is hidden all the same."""
    if "@" not in url:  # the common case
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    cut = min(ends, default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    if "@" not in authority:
        return url  # an @ in the path or query, not credentials
    return f"{scheme}{sep}{_HIDDEN}@{authority.rpartition('@')[2]}{tail}"
