"""The two edges answer the same request alike: the HTTP proxy (`kvgate serve`) and the Envoy
endpoint picker (a real Envoy in front of `kvgate epp`), over one simulated replica, for the
requests where they used to differ -- a JSON body sent under another content type, a
`previous_response_id` that is not a string, and a stored response's cancel with a body over
`server.max_body_bytes`.

What reaches the replica is read from its own request log (`/sim/requests`), matched by the
X-Request-Id the test sends.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
LIMIT = 4096  # server.max_body_bytes of both edges


@dataclass
class Edges:
    http: str
    envoy: str
    sim: str

    def seen(self, request_id: str) -> dict[str, Any] | None:
        """The replica's record of the request with this id, if it got there."""
        for item in httpx.get(f"{self.sim}/sim/requests", timeout=5).json()["requests"]:
            if item["headers"].get("x-request-id") == request_id:
                return dict(item)
        return None


@pytest.fixture(scope="module")
def edges() -> Iterator[Edges]:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "20", "--enable-store", model=MODEL)
        procs.append(sim.start())
        gw, http = gateway_proc(upstreams=[url],
                                env={"KVGATE_SERVER__MAX_BODY_BYTES": str(LIMIT)})
        procs.append(gw.start())
        epp = epp_proc(config={"pools": {"default": {"served_model": MODEL, "replicas": [url]}},
                               "server": {"max_body_bytes": LIMIT}})
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        yield Edges(http, base, url)
    finally:
        for proc in reversed(procs):
            proc.stop()


EDGES = ["http", "envoy"]


def _base(edges: Edges, edge: str) -> str:
    return edges.http if edge == "http" else edges.envoy


@pytest.mark.parametrize("edge", EDGES)
def test_a_json_body_under_another_content_type_reaches_the_replica_as_json(
    edges: Edges, edge: str,
) -> None:
    """kvgate parses the body as JSON whatever its declared type (curl's `-d` sends a form
    type) and sends it on as `application/json`, which is all vLLM takes (it refuses another
    type); the picker used to pass the client's type on, so vLLM refused it there only."""
    rid = f"ct-{uuid.uuid4().hex}"
    body = b'{"model": "sim-model", "prompt": "hi", "max_tokens": 2}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        resp = httpx.post(f"{_base(edges, edge)}/v1/completions", content=body, timeout=10,
                          headers={"content-type": content_type, "x-request-id": rid})
        assert resp.status_code == 200, resp.text
        seen = edges.seen(rid)
        assert seen is not None and seen["headers"]["content-type"] == "application/json"


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("prev", [123, ["resp_a"], {"id": "resp_a"}, True])
def test_a_previous_response_id_that_is_not_a_string_is_a_400(
    edges: Edges, edge: str, prev: object,
) -> None:
    """vLLM answers 400 for it; it used to reach the replica, to be routed as an unknown id."""
    rid = f"prev-{uuid.uuid4().hex}"
    resp = httpx.post(f"{_base(edges, edge)}/v1/responses", timeout=10,
                      headers={"x-request-id": rid},
                      json={"model": MODEL, "input": "hi", "previous_response_id": prev})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"]) == ("BadRequestError", "previous_response_id")
    assert edges.seen(rid) is None


@pytest.mark.parametrize("edge", EDGES)
def test_a_cancel_body_over_the_limit_is_a_413(edges: Edges, edge: str) -> None:
    """`POST /v1/responses/{id}/cancel` takes no body; one over `server.max_body_bytes` is
    refused as any other body is, declared or streamed (the picker used to pass it on
    unbounded). A small one does not stand in the way."""
    base = _base(edges, edge)
    created = httpx.post(f"{base}/v1/responses", timeout=10,
                         json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
    assert created.status_code == 200, created.text
    url = f"{base}/v1/responses/{created.json()['id']}/cancel"
    declared = httpx.post(url, content=b"x" * (LIMIT + 1), timeout=10)
    assert declared.status_code == 413, declared.text
    assert declared.json()["error"]["type"] == "RequestEntityTooLargeError"

    def chunks() -> Iterator[bytes]:
        for _ in range(4):
            yield b"y" * (LIMIT // 2)

    streamed = httpx.post(url, content=chunks(), timeout=10)
    assert streamed.status_code == 413, streamed.text
    small = httpx.post(url, content=b"{}", timeout=10)
    # the replica's own answer: the response has finished, there is nothing to cancel
    assert small.status_code == 400, small.text
