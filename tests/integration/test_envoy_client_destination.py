"""A client's own ``x-gateway-destination-endpoint`` never routes a request.

The bootstrap's ``ORIGINAL_DST`` cluster connects to whatever address that header names. The
picker overwrites it on every request it picks, but a request Envoy sends on unpicked -- FailOpen
(`failure_mode_allow`) while the picker is down -- kept the client's: any client reached any
address Envoy can reach (the picker's own /metrics, an internal service), no key asked. Envoy
now drops the client's header before the picker sees the request; such a request has no
destination, Envoy's "no healthy upstream" 503, as documented.
"""

from __future__ import annotations

import httpx

from gateway.epp.wire import DESTINATION, WHOLE
from tests.support.epp import envoy_proc, epp_proc
from tests.support.procs import Proc, free_port, sim_proc

MODEL = "sim-model"


def _internal(procs: list[Proc]) -> str:
    """Something on the network a client must not reach through Envoy: a replica's own
    request log here (host:port)."""
    sim, url = sim_proc(None, model=MODEL)
    procs.append(sim.start())
    return url.removeprefix("http://")


def test_failopen_without_the_picker_does_not_go_where_the_client_says(
    procs: list[Proc],
) -> None:
    target = _internal(procs)
    envoy, base = envoy_proc(f"127.0.0.1:{free_port()}", failure_mode_allow=True)  # no picker
    procs.append(envoy.start())
    for path in ("/sim/requests", "/v1/models"):
        resp = httpx.get(f"{base}{path}", headers={DESTINATION: target}, timeout=30)
        assert resp.status_code == 503, (path, resp.text[:200])
        assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert httpx.get(f"http://{target}/sim/requests", timeout=10).json()["requests"] == []


def test_the_picker_sees_neither_header_of_the_client(procs: list[Proc]) -> None:
    """The picker's destination is the one used (it always was), and a client's
    ``x-kvgate-whole`` does not choose the route without a first-byte timeout."""
    target = _internal(procs)
    sim, url = sim_proc(None, model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker)
    procs.append(envoy.start())
    resp = httpx.post(f"{base}/v1/completions", timeout=30,
                      headers={DESTINATION: target, WHOLE: "1"},
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
    assert resp.status_code == 200 and "data: [DONE]" in resp.text
    assert httpx.get(f"http://{target}/sim/requests", timeout=10).json()["requests"] == []
    (seen,) = httpx.get(f"{url}/sim/requests", timeout=10).json()["requests"]
    assert seen["headers"][DESTINATION] == url.removeprefix("http://")
    assert WHOLE not in seen["headers"]
