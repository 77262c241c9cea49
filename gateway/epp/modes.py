"""The ext_proc filter's body modes as Envoy states them (the first message's
``protocol_config``), and the picker's answers in ``BUFFERED`` request body mode.

The picker reads the whole request body before it can pick (the model, the prompt), then says
where the request goes in headers Envoy has not sent upstream yet. Two request body modes
allow that: ``FULL_DUPLEX_STREAMED`` (the shipped bootstrap's: the headers' answer waits for
the body) and ``BUFFERED`` (the headers are answered at once, unchanged; the whole body comes
in one message, whose answer carries the destination as header mutations -- Envoy applies a
body answer's header mutations in that mode only -- and the new body). ``STREAMED``,
``BUFFERED_PARTIAL`` and ``GRPC`` send the body after the headers went upstream, ``NONE``
never: no pick is possible, so such a request is refused at its headers with a 500 naming
the mode (it waited ``server.body_timeout_s`` for the 408 "The request body did not arrive
in time.", a ``BUFFERED`` body too). The answer path needs ``FULL_DUPLEX_STREAMED`` (a
stream's head is held until its first bytes, a whole answer until its end: Envoy sends no
body before the head is answered); any other response body mode is refused alike. A data plane that
states no modes is taken to run the shipped ones.

A filter in ``observability_mode`` (Envoy sends the messages and does not wait for answers:
each ``ProcessingRequest`` says so) cannot be picked for at all: Envoy routes the request
before the picker could answer, and drops its answers. Such a stream is read to its end and
answered nothing (no lease, no route recorded, no request counted: it went wherever Envoy's
route sent it); the error is said once in the log and each request counted in
``kvgate_epp_misconfigured_total{setting="observability_mode"}`` (`Misconfigured`), as are
the other settings the picker cannot work with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry, Counter

from gateway.errors import KvgateError

__all__ = ["BUFFERED", "OBSERVED", "Misconfigured", "buffered_body", "headers_skipped",
           "misconfigured", "modes", "unsupported"]

log = logging.getLogger("gateway.epp")
_said: set[str] = set()

_MODE = ProcessingMode.BodySendMode
BUFFERED = _MODE.Value("BUFFERED")
_FULL_DUPLEX = _MODE.Value("FULL_DUPLEX_STREAMED")
_REQUEST_OK = frozenset({BUFFERED, _FULL_DUPLEX})


def modes(msg: pb.ProcessingRequest) -> tuple[int, int] | None:
    """(request body mode, response body mode) as the data plane states them, or None."""
    if not msg.HasField("protocol_config"):
        return None
    config = msg.protocol_config
    return int(config.request_body_mode), int(config.response_body_mode)


def unsupported(stated: tuple[int, int], has_body: bool) -> KvgateError | None:
    """The 500 for body modes the picker cannot serve a request in, or None. A request
    without a body is served in any request body mode (its headers are all it needs)."""
    request, response = stated
    wrong = []
    if has_body and request not in _REQUEST_OK:
        wrong.append(f"request_body_mode {_MODE.Name(request)} (it takes FULL_DUPLEX_STREAMED"
                     " or BUFFERED: the destination depends on the body)")
    if response != _FULL_DUPLEX:
        wrong.append(f"response_body_mode {_MODE.Name(response)} (it takes"
                     " FULL_DUPLEX_STREAMED)")
    if not wrong:
        return None
    return KvgateError(
        "The gateway is misconfigured: its Envoy ext_proc filter sends the endpoint picker "
        + " and ".join(wrong) + "; see kvgate's docs/envoy.md.", reason="processing_mode")


def buffered_body(answers: Sequence[pb.ProcessingResponse]) -> list[pb.ProcessingResponse]:
    """The picker's answers for a streamed body -- the request headers' (destination,
    credentials, content length; the route cache cleared) then the new body in chunks --
    as the one answer a ``BUFFERED`` body takes: its header mutations, the whole new body."""
    if not answers:  # nothing to change: the body passes (Envoy waits for an answer)
        return [pb.ProcessingResponse(request_body=pb.BodyResponse())]
    if not answers[0].HasField("request_headers"):
        return list(answers)  # a refusal (an immediate response)
    head = answers[0]
    common = pb.CommonResponse()
    common.CopyFrom(head.request_headers.response)
    common.body_mutation.body = b"".join(
        a.request_body.response.body_mutation.streamed_response.body for a in answers[1:])
    out = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    if head.HasField("dynamic_metadata"):
        out.dynamic_metadata.CopyFrom(head.dynamic_metadata)
    return [out]


def misconfigured(message: str) -> None:
    """Said once per process in the log (each request meets it alike)."""
    if message not in _said:
        _said.add(message)
        log.error("%s", message)


OBSERVED = ("The gateway is misconfigured: its Envoy ext_proc filter runs in observability_mode"
            " (Envoy does not wait for the endpoint picker's answers): no request can be picked"
            " for, each goes where Envoy's route sends it without the picker; set"
            " observability_mode: false, see kvgate's docs/envoy.md.")


class Misconfigured:
    """Requests met with a filter setting the picker cannot work with: said once in the log,
    each counted (``kvgate_epp_misconfigured_total{setting}``), so a dashboard shows it
    while it lasts."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._count = Counter(
            "kvgate_epp_misconfigured_total",
            "requests met with an Envoy ext_proc filter setting the endpoint picker cannot"
            " pick in", ["setting"], registry=registry)

    def __call__(self, setting: str, message: str) -> None:
        self._count.labels(setting=setting).inc()
        misconfigured(message)


def headers_skipped() -> tuple[str, str]:
    """An answer's body came without its headers: the filter skips them
    (``response_header_mode: SKIP``), which Envoy does not state. The answer passes, but the
    picker never sees its status: counted as a client that left, no usage charged, no first
    token learnt -- said in the log, as nothing else would show it. (setting, message) for
    `Misconfigured`."""
    return ("response_header_mode",
            "The gateway is misconfigured: its Envoy ext_proc filter skips the response "
            "headers (response_header_mode SKIP): the endpoint picker cannot see the "
            "answers' status, usage or first token (each is counted 499, no tokens "
            "charged); set it to SEND, see kvgate's docs/envoy.md.")
