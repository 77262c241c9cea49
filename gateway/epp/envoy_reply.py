"""Who made an answer that Envoy shows the picker after it sent the request on: the replica, or
Envoy itself (a local reply). Envoy's router answers for a replica that sent no head -- its
timeout, a connection refused or broken, its circuit breaker -- and any filter after the
picker's may answer before the router sends anything (a rate limit's 429, an authorization
filter's 403, a route to a cluster with no healthy endpoint's 503 "no healthy upstream").
None of these is the replica's answer: the router's say something about the replica
(`Deadlines.router_cut`, `router_reset`), the others nothing (passed on, not judged).

Envoy says which through the ``response.code_details`` response attribute (the bootstrap
asks for it: "via_upstream" for an endpoint's answer, else the local reply's details, e.g.
``upstream_reset_before_response_started{remote_connection_failure|...}``,
``no_healthy_upstream``, ``local_rate_limited``). A data plane that does not send it is read
by the router's plain-text bodies, as before (`wire.ROUTER_TIMEOUT`, `wire.ROUTER_RESET`);
another filter's reply is then taken for the replica's."""

from __future__ import annotations

from typing import Literal

from gateway.epp import wire

__all__ = ["Maker", "local", "maker"]

# "replica": the endpoint's own answer; "timeout": the router cut a replica that sent no head;
# "connect": it could not connect; "reset": the connection broke before the head; "overflow":
# its circuit breaker sent nothing; "local": a filter or Envoy answered, no replica was asked
Maker = Literal["replica", "timeout", "connect", "reset", "overflow", "local"]

VIA_UPSTREAM = "via_upstream"
ROUTER = "upstream_"
RESET = "upstream_reset_before_response_started"
# the router's timeouts (Envoy's `StreamInfo::ResponseCodeDetails`)
TIMEOUTS = frozenset({"upstream_response_timeout", "upstream_per_try_timeout",
                      "upstream_per_try_idle_timeout"})


def local(details: str | None) -> bool:
    """Envoy says the answer is its own and not its router's (whose details all start with
    ``upstream_``): no replica was asked."""
    return (details is not None and details != VIA_UPSTREAM
            and not details.startswith(ROUTER))


def maker(details: str | None, status: int, body: bytes) -> Maker:
    """Who made the answer: from Envoy's code `details`, else (a data plane that does not send
    them, a router's answer they do not name) from the router's plain-text bodies."""
    if details == VIA_UPSTREAM:
        return "replica"
    if local(details):
        return "local"
    if details in TIMEOUTS or (status == 504 and body == wire.ROUTER_TIMEOUT):
        return "timeout"
    if details is not None and details.startswith(RESET):
        return _reset(details)
    if status == 503 and body.startswith(wire.ROUTER_RESET):
        return _reset(body.decode("latin-1"))
    return "replica"


def _reset(why: str) -> Maker:
    """A reset before the head, by its reason (the details' braces, the body's end)."""
    if "overflow" in why:
        return "overflow"
    if "remote_connection_failure" in why or "remote connection failure" in why:
        return "connect"
    return "reset"
