"""The picker's ext_proc messages (gateway/epp/wire.py) and endpoint names."""

from __future__ import annotations

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from gateway.epp import wire
from gateway.epp.exchange import endpoint, replica_key
from gateway.replicas import HealthRules, Replica


def _meta(namespace: str, values: dict[str, object]) -> Metadata:
    struct = Struct()
    struct.update(values)
    return Metadata(filter_metadata={namespace: struct})


@pytest.mark.parametrize(("values", "expected"), [
    ({wire.SUBSET_KEY: ["10.0.0.1:8000", "10.0.0.2:8000"]}, ["10.0.0.1:8000", "10.0.0.2:8000"]),
    ({wire.SUBSET_KEY: []}, []),  # an empty list: nothing is eligible (the picker's 503)
    ({wire.SUBSET_KEY: "10.0.0.1:8000, 10.0.0.2:8000"}, ["10.0.0.1:8000", "10.0.0.2:8000"]),
    ({"other": ["10.0.0.1:8000"]}, None),
])
def test_subset_hint(values: dict[str, object], expected: list[str] | None) -> None:
    msg = pb.ProcessingRequest(metadata_context=_meta(wire.SUBSET_NAMESPACE, values))
    assert wire.subset_hint(msg) == expected


def test_no_subset_namespace_is_no_restriction() -> None:
    assert wire.subset_hint(pb.ProcessingRequest()) is None


def test_served_endpoint_prefers_the_protocols_metadata_over_the_attribute() -> None:
    msg = pb.ProcessingRequest(
        metadata_context=_meta(wire.LB_NAMESPACE, {wire.DESTINATION_SERVED: "10.0.0.2:80"}))
    attrs = Struct()
    attrs.update({"upstream.address": "10.0.0.3:80"})
    msg.attributes[wire.UPSTREAM_ATTRIBUTES].CopyFrom(attrs)
    assert wire.served_endpoint(msg) == "10.0.0.2:80"
    only_attr = pb.ProcessingRequest()
    only_attr.attributes[wire.UPSTREAM_ATTRIBUTES].CopyFrom(attrs)
    assert wire.served_endpoint(only_attr) == "10.0.0.3:80"
    assert wire.served_endpoint(pb.ProcessingRequest()) is None


@pytest.mark.parametrize("size", [0, 1, wire.CHUNK_BYTES, wire.CHUNK_BYTES + 1,
                                  3 * wire.CHUNK_BYTES + 7])
def test_body_responses_chunk_and_end_on_the_last(size: int) -> None:
    body = bytes(range(256)) * (size // 256 + 1)
    body = body[:size]
    out = [r.response_body.response.body_mutation.streamed_response
           for r in wire.body_responses(body, True)]
    assert b"".join(s.body for s in out) == body
    assert all(len(s.body) <= wire.CHUNK_BYTES for s in out)
    assert [s.end_of_stream for s in out] == [False] * (len(out) - 1) + [True]
    assert len(out) == max(1, -(-size // wire.CHUNK_BYTES))


def test_request_body_responses_are_request_answers() -> None:
    (answer,) = wire.body_responses(b"{}", False, request=True)
    assert answer.HasField("request_body")
    assert not answer.request_body.response.body_mutation.streamed_response.end_of_stream


def test_the_destination_is_one_value_in_header_and_metadata_and_overwrites() -> None:
    resp = wire.destination_response("10.0.0.1:8000,10.0.0.2:8000", 42,
                                     [("x-request-id", b"abc")], ["authorization"])
    common = resp.request_headers.response
    assert common.clear_route_cache
    options = common.header_mutation.set_headers
    headers = {o.header.key: o.header.raw_value for o in options}
    assert headers[wire.DESTINATION] == b"10.0.0.1:8000,10.0.0.2:8000"
    assert headers["content-length"] == b"42" and headers["x-request-id"] == b"abc"
    # a client's own x-gateway-destination-endpoint header is replaced, not appended to
    assert {o.append_action for o in options} == {HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD}
    assert list(common.header_mutation.remove_headers) == ["authorization"]
    lb = resp.dynamic_metadata.fields[wire.LB_NAMESPACE].struct_value.fields
    assert lb[wire.DESTINATION].string_value == "10.0.0.1:8000,10.0.0.2:8000"


def test_immediate_response() -> None:
    resp = wire.immediate(429, b'{"error":{}}', [("retry-after", b"3")], "kvgate_RateLimitError")
    ir = resp.immediate_response
    assert ir.status.code == 429 and ir.body == b'{"error":{}}'
    assert ir.details == "kvgate_RateLimitError"
    assert [(h.header.key, h.header.raw_value) for h in ir.headers.set_headers] == \
        [("retry-after", b"3")]


@pytest.mark.parametrize(("url", "name"), [
    ("http://10.1.2.3:8000", "10.1.2.3:8000"),
    ("http://[fd00::5]:8000", "[fd00::5]:8000"),
])
def test_endpoint_names_round_trip(url: str, name: str) -> None:
    replica = Replica("p", url, HealthRules())
    assert endpoint(replica) == name
    assert replica_key(name) == replica.id


def test_an_answers_media_type_is_read_in_any_case() -> None:
    # (a replica or proxy sending Application/JSON or Text/Event-Stream had every answer
    # taken for a page, a 502 charged to the replica, as on the HTTP edge before)
    def headers(content_type: bytes) -> HeaderMap:
        return HeaderMap(headers=[HeaderValue(key=":status", raw_value=b"200"),
                                  HeaderValue(key="content-type", raw_value=content_type)])

    assert wire.status_of(headers(b"Text/Event-Stream; charset=UTF-8").headers) == (
        200, "text/event-stream; charset=UTF-8")
    assert wire.status_of(headers(b"APPLICATION/JSON").headers) == (200, "application/json")
