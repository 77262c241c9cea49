"""A request body past Envoy's buffer limit with the ext_proc filter in ``BUFFERED`` request
body mode (a real Envoy): Envoy's own 413, OpenAI-shaped by the picker, nothing sent to a
replica, nothing left in flight; a body under it is served (docs/envoy.md)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.integration.test_epp_processing_modes import _modes, _seen
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import inflight, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in reversed(started):
        proc.stop()


def test_a_buffered_body_past_envoys_limit_is_an_openai_413(procs: list[Proc]) -> None:
    sim, url = sim_proc(None, model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker, edit=_modes(request_body_mode="BUFFERED"))
    procs.append(envoy.start())
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    # past the listener's 1 MiB buffer, under the picker's own 8 MiB body limit
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt="x " * 1_000_000, max_tokens=1)
    assert err.value.status_code == 413
    assert err.value.body["type"] == "RequestEntityTooLargeError"  # type: ignore[index]
    assert _seen(url) == []
    assert client.completions.create(model=MODEL, prompt="x " * 1000, max_tokens=1).choices
    wait_for(lambda: inflight(epp.base) == 0, 30, "in-flight back to 0")
