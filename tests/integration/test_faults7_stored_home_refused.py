"""A stored response whose home replica was killed, met by its `GET` before the health checks
found the replica down (their interval is long here): the refused connection finds it down
at once, and the answer is the 503 with `Retry-After` a down holder gets (the response may be
back with its replica), as every later `GET` gets it -- not the 502 "The replica holding
this response did not answer." the first one got before. Once the replica is back on its
address having lost its store, the `GET` is vLLM's own 404.

Real gateway, one simulated replica (killed, then started again on its port), the official
client.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import openai
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc, free_port, sim_proc

MODEL = "sim-model"
# no probe between the kill and the GET (the one at start only)
ENV = {"KVGATE_HEALTH__INTERVAL_S": "3600"}


@pytest.fixture
def stack() -> Iterator[tuple[list[Proc], str]]:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "50", "--enable-store", model=MODEL)
        procs.append(sim.start())
        gw, base = gateway_proc(upstreams=[url], env=ENV)
        procs.append(gw.start())
        yield procs, base
    finally:
        for p in reversed(procs):
            p.stop()


def test_a_killed_holder_met_first_by_the_get_is_a_503(
    stack: tuple[list[Proc], str],
) -> None:
    procs, base = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    made = client.responses.create(model=MODEL, input="remember this", max_output_tokens=4)
    procs[0].signal(signal.SIGKILL)
    assert procs[0].popen is not None
    procs[0].popen.wait()
    for _ in range(2):  # the first GET (the refusal) and the next (the replica known down)
        with pytest.raises(openai.APIStatusError) as err:
            client.responses.retrieve(made.id)
        assert err.value.status_code == 503, (err.value.status_code, err.value.body)
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert made.id in err.value.message and "unavailable" in err.value.message


def test_a_holder_back_without_its_store_is_vllms_404() -> None:
    procs: list[Proc] = []
    try:
        port = free_port()
        sim, url = sim_proc(port, "--time-scale", "50", "--enable-store", model=MODEL)
        procs.append(sim.start())
        gw, base = gateway_proc(upstreams=[url])  # (fast health: it is probed back)
        procs.append(gw.start())
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        made = client.responses.create(model=MODEL, input="remember this", max_output_tokens=4)
        sim.signal(signal.SIGKILL)
        assert sim.popen is not None
        sim.popen.wait()
        again, _ = sim_proc(port, "--time-scale", "50", "--enable-store", model=MODEL)
        procs.append(again.start())

        def gone() -> bool:
            try:
                client.responses.retrieve(made.id)
            except openai.NotFoundError:
                return True
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, (exc.status_code, exc.body)
            return False

        wait_for(gone, timeout=30, what="vLLM's 404 once its holder is back")
    finally:
        for p in reversed(procs):
            p.stop()
