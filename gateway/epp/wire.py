"""The ext_proc messages the picker reads and writes (Envoy's generated protos, `xds-protos`).

Reading: the few request headers kvgate needs (and an answer's status, content type and
length), the subset hint (filter metadata
``envoy.lb.subset_hint``), and the endpoint that served (``envoy.lb`` metadata, as the
endpoint picker protocol says, or the ``upstream.address`` response attribute, which plain
Envoy sends when its ext_proc filter asks for it). Writing: the request-headers answer with
the destination (header and ``envoy.lb`` dynamic metadata, the same value), the body re-sent
in chunks of at most `CHUNK_BYTES`, pass-through answers, and immediate responses. Every header
kvgate sets overwrites a client's header of the same name (a client must not add a
destination of its own: Envoy's default action appends).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct, Value

__all__ = [
    "CHUNK_BYTES",
    "CODE_DETAILS",
    "DESTINATION",
    "DESTINATION_SERVED",
    "LB_NAMESPACE",
    "MAX_RETRIES",
    "ROUTER_TIMEOUT",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "WHOLE",
    "body_responses",
    "code_details",
    "declared_length",
    "destination_response",
    "header_value",
    "headers_response",
    "immediate",
    "served_endpoint",
    "status_of",
    "subset_hint",
]

DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# set by the picker on a request whose answer comes whole (not streamed): the bootstrap's
# route for it has no per-try idle timeout (`envoy.envoy_config`), and removes it upstream
WHOLE = "x-kvgate-whole"
# the body of Envoy's own 504 when its router's per-try idle or route timeout cut a replica
# that sent no head (the picker sees it as the answer; no replica answered)
ROUTER_TIMEOUT = b"upstream request timeout"
# the start of Envoy's own 503 when its router could not connect to the replica, or lost the
# connection before the head ("... reset reason: connection termination"; "... remote
# connection failure" when the connect itself failed, "... overflow" at its circuit breaker)
ROUTER_RESET = b"upstream connect error or disconnect/reset before headers."
UPSTREAM_ATTRIBUTES = "envoy.filters.http.ext_proc"
# the response attribute saying who made the answer: "via_upstream" for an endpoint's, else
# Envoy's own reply's details (`gateway.epp.envoy_reply`)
CODE_DETAILS = "response.code_details"
# the retries Envoy's router may make for the request (it overrides the route's): the picker's
# destination list has as many endpoints after the first, and no more (past its end, Envoy's
# override_host policy falls back to round robin over the whole cluster)
MAX_RETRIES = "x-envoy-max-retries"
# Envoy's ext_proc limits a streamed body message to 64 KiB in some set-ups: stay below
CHUNK_BYTES = 62_000

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
Header = tuple[str, bytes]


def _options(headers: Iterable[Header]) -> list[HeaderValueOption]:
    return [HeaderValueOption(header=HeaderValue(key=k, raw_value=v), append_action=_OVERWRITE)
            for k, v in headers]


def _struct_value(struct: Struct, key: str) -> str | list[str] | None:
    field = struct.fields.get(key)
    if field is None:
        return None
    kind = field.WhichOneof("kind")
    if kind == "string_value":
        return str(field.string_value)
    if kind == "list_value":
        return [v.string_value for v in field.list_value.values]
    return None


def subset_hint(msg: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the data plane allows for this request (None: no restriction)."""
    meta = msg.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta:
        return None
    value = _struct_value(meta[SUBSET_NAMESPACE], SUBSET_KEY)
    if isinstance(value, str):  # one string (a header copied to metadata): comma-separated
        return [e.strip() for e in value.split(",") if e.strip()]
    return value if isinstance(value, list) else None


def served_endpoint(msg: pb.ProcessingRequest) -> str | None:
    """``ip:port`` of the endpoint that answered, when the data plane says."""
    meta = msg.metadata_context.filter_metadata
    if LB_NAMESPACE in meta:
        served = _struct_value(meta[LB_NAMESPACE], DESTINATION_SERVED)
        if isinstance(served, str) and served:
            return served
    attrs = msg.attributes
    if UPSTREAM_ATTRIBUTES in attrs:
        address = _struct_value(attrs[UPSTREAM_ATTRIBUTES], "upstream.address")
        if isinstance(address, str) and address:
            return address
    return None


def code_details(msg: pb.ProcessingRequest) -> str | None:
    """Envoy's response code details for the answer (`CODE_DETAILS`), when it says."""
    attrs = msg.attributes
    if UPSTREAM_ATTRIBUTES not in attrs:
        return None
    details = _struct_value(attrs[UPSTREAM_ATTRIBUTES], CODE_DETAILS)
    return details if isinstance(details, str) and details else None


def destination_response(
    destination: str, body_length: int | None, set_headers: Sequence[Header],
    remove: Sequence[str],
) -> pb.ProcessingResponse:
    """The answer to the request headers: where to send it (header and metadata, one value),
    the new body's length (None: the body passes unchanged), the upstream's headers; the
    route is re-evaluated."""
    meta = Struct(fields={LB_NAMESPACE: Value(struct_value=Struct(
        fields={DESTINATION: Value(string_value=destination)}))})
    headers = [(DESTINATION, destination.encode()), *set_headers]
    if body_length is not None:
        headers.append(("content-length", str(body_length).encode()))
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            clear_route_cache=True,
            header_mutation=pb.HeaderMutation(
                set_headers=_options(headers), remove_headers=list(remove)),
        )),
        dynamic_metadata=meta,
    )


def headers_response(
    set_headers: Sequence[Header] = (), remove: Sequence[str] = (), *, request: bool = False,
) -> pb.ProcessingResponse:
    """Headers passed on (response headers by default), with kvgate's additions."""
    common = pb.CommonResponse()
    if set_headers or remove:
        common.header_mutation.CopyFrom(pb.HeaderMutation(
            set_headers=_options(set_headers), remove_headers=list(remove)))
    answer = pb.HeadersResponse(response=common)
    if request:
        return pb.ProcessingResponse(request_headers=answer)
    return pb.ProcessingResponse(response_headers=answer)


def _body(chunk: bytes, end: bool, request: bool) -> pb.ProcessingResponse:
    answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end))))
    if request:
        return pb.ProcessingResponse(request_body=answer)
    return pb.ProcessingResponse(response_body=answer)


def body_responses(
    body: bytes, end: bool, *, request: bool = False
) -> list[pb.ProcessingResponse]:
    """`body` as streamed body answers of at most `CHUNK_BYTES` each; `end` on the last."""
    if len(body) <= CHUNK_BYTES:
        return [_body(body, end, request)]
    view = memoryview(body)
    cuts = range(0, len(body), CHUNK_BYTES)
    return [_body(bytes(view[i:i + CHUNK_BYTES]), end and i + CHUNK_BYTES >= len(body), request)
            for i in cuts]


def trailers_response(*, request: bool) -> pb.ProcessingResponse:
    if request:
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate(
    status: int, body: bytes, headers: Sequence[Header], details: str
) -> pb.ProcessingResponse:
    """Answer the client directly (Envoy sends it and ends the exchange)."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=_options(headers)),
        body=body, details=details,
    ))


def header_value(headers: Any, key: str) -> str | None:
    """The value of the header `key` (lowercase), if any."""
    for h in headers:
        if h.key == key:
            return str(h.raw_value.decode("latin-1"))
    return None


def declared_length(headers: Any) -> int | None:
    """The declared content-length, if any."""
    for h in headers:
        if h.key == "content-length" and h.raw_value.isdigit():
            return int(h.raw_value)
    return None


def status_of(headers: Any) -> tuple[int, str]:
    status, content_type = 0, ""
    for h in headers:
        if h.key == ":status":
            status = int(h.raw_value) if h.raw_value.isdigit() else 0
        elif h.key == "content-type":
            # media types are case-insensitive (RFC 9110 8.3.1): lower case, as compared (the
            # HTTP edge's `H1Conn`)
            media, sep, params = h.raw_value.partition(b";")
            content_type = (media.lower() + sep + params).decode("latin-1")
    return status, content_type
