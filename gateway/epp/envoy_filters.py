"""The HTTP filters of kvgate's Envoy bootstrap (`gateway/epp/envoy.py`): the client's
destination header dropped, the subset hint (tests only), the picker called over ext_proc; and
the local-reply mappers that make Envoy's own answers (picker down, at its limit, a replica cut
after its head, no healthy upstream) OpenAI-shaped."""

from __future__ import annotations

from typing import Any

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
    "AT_LIMIT", "CUT_AFTER_HEAD", "NO_HEALTHY", "PICKER_DOWN", "TYPES",
    "client_headers_dropped", "ext_proc_filter", "local_replies", "subset_from_header",
]

TYPES = "type.googleapis.com/envoy.extensions"


def ext_proc_filter(picker_cluster: str, fail_open: bool) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
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


def local_replies() -> dict[str, Any]:
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



def subset_from_header(header: str) -> dict[str, Any]:
    """Tests only: the subset hint from a request header (a real gateway sets it itself)."""
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": f"{TYPES}.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": header, "remove": True, "on_header_present": {
                "metadata_namespace": SUBSET_NAMESPACE, "key": SUBSET_KEY, "type": "STRING"}}],
        },
    }



def client_headers_dropped() -> dict[str, Any]:
    """First: a client's destination header (and route marker) dropped. A request sent on
    unpicked (FailOpen, the picker down) kept it, and ``ORIGINAL_DST`` went to any address."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": f"{TYPES}.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION}, {"remove": WHOLE}]},
        },
    }

