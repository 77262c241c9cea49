"""What Envoy, or a filter before the picker's, answers itself (a local reply) passes through
the picker's response path with no request before it: the stream's first message is the
answer's headers. A real Envoy with a Gateway implementation's usual filters in front of the
ext_proc one: an authorization filter (RBAC) refusing a request, a health check answering
one. Envoy's own local reply while a request's body is still arriving (its stream idle
timeout's 408, shorter than the picker's body timeout) was read as the replica's answer to a
request not sent yet: the picker failed, and the client got Envoy's 503 "The endpoint picker
is unavailable".

It was read as a stored response's answer: the filter's 403 became the 502 "The replica
refused the gateway's credentials" (x-should-retry: false; the client was told the gateway is
misconfigured), and the health check's 200 the 502 for an answer that is not JSON. Now its
status is kept, an error's body OpenAI-shaped (the filter's text as the message), a 200 passed
as it is; nothing is counted or judged.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
import openai
import pytest

from gateway.config.sections import UpstreamConfig
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import inflight, request_statuses, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
_FILTERS = "type.googleapis.com/envoy.extensions.filters.http"


def _front_filters(config: dict[str, Any]) -> None:
    """An RBAC filter denying requests with ``x-blocked``, and a health check answering
    ``/healthz``, both before ext_proc."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    hcm["http_filters"][:0] = [
        {"name": "envoy.filters.http.rbac", "typed_config": {
            "@type": f"{_FILTERS}.rbac.v3.RBAC",
            "rules": {"action": "DENY", "policies": {"blocked": {
                "permissions": [{"header": {"name": "x-blocked", "present_match": True}}],
                "principals": [{"any": True}]}}}}},
        {"name": "envoy.filters.http.health_check", "typed_config": {
            "@type": f"{_FILTERS}.health_check.v3.HealthCheck", "pass_through_mode": False,
            "headers": [{"name": ":path", "string_match": {"exact": "/healthz"}}]}},
    ]


def test_a_filters_local_reply_keeps_its_status(procs: list[Proc]) -> None:
    sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker, edit=_front_filters)
    procs.append(envoy.start())
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_headers={"x-blocked": "1"})
    assert denied.value.status_code == 403
    assert denied.value.response.json()["error"]["message"] == "RBAC: access denied"
    assert "x-should-retry" not in denied.value.response.headers
    health = httpx.get(f"{base}/healthz", timeout=10)
    assert health.status_code == 200, health.text
    # the picker serves on, and counted none of them as a request of its own
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    # the picker counts a request as Envoy tells it the exchange ended, which can come
    # a moment after the client has read the last byte
    wait_for(lambda: request_statuses(epp.base) == {"200": 1}, 10, "the picker's count")
    assert inflight(epp.base) == 0


def test_envoys_timeout_of_a_body_still_arriving_is_its_408(procs: list[Proc]) -> None:
    sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}},
                           "server": {"body_timeout_s": 60}})
    procs.append(epp.start())
    # Envoy's stream idle timeout is twice the first-byte one: 2 s, the picker's body one 60 s
    envoy, base = envoy_proc(epp.picker, upstream=UpstreamConfig(first_byte_timeout_s=1))
    procs.append(envoy.start())
    body = b'{"model": "sim-model", "prompt": "x", "max_tokens": 2}'
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:20]))
        conn.settimeout(30)
        answer = b""
        while chunk := conn.recv(65536):  # (Envoy closes the connection after it)
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert b'"message":"stream timeout"' in rest and b'"code":408' in rest
    # the picker counts a request as Envoy tells it the exchange ended, which can come
    # a moment after the client has read the last byte
    wait_for(lambda: request_statuses(epp.base) == {"408": 1}, 10, "the picker's count")
    assert inflight(epp.base) == 0
