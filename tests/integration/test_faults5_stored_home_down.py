"""A stored response whose replica is down: vLLM keeps a stored response (and what
`previous_response_id` continues) in its own process only, so no other replica can answer
for it. While that replica is down, `GET /v1/responses/{id}` and a follow-up naming it answer
a 503 with `Retry-After` saying where it is (it may come back with the response: a frozen
process, a network cut), at once.

Before: a killed home was a 502 "could not connect" (a follow-up too), and a frozen one
(SIGSTOP, found down by its health checks) held both until the first-byte timeout (here
the client's 10 s came first). Real gateway, two simulated replicas, the official client.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import openai
import pytest

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
ENV = {"KVGATE_HEALTH__INTERVAL_S": "0.3", "KVGATE_HEALTH__TIMEOUT_S": "0.5",
       "KVGATE_ROUTING__POLICY": "round_robin"}


@pytest.fixture
def stack() -> Iterator[tuple[list[Proc], list[str], str]]:
    procs: list[Proc] = []
    try:
        sims = [sim_proc(None, "--time-scale", "50", "--enable-store", model=MODEL)
                for _ in range(2)]
        for p, _ in sims:
            procs.append(p.start())
        gw, base = gateway_proc(upstreams=[u for _, u in sims], env=ENV)
        procs.append(gw.start())
        yield [p for p, _ in sims], [u.removeprefix("http://") for _, u in sims], base
    finally:
        for p in reversed(procs):
            p.signal(signal.SIGCONT)
            p.stop()


def _down(base: str, replica: str) -> bool:
    healthy = metric_values(base, "kvgate_replica_healthy")
    return any(replica in k and v == 0 for k, v in healthy.items())


def _expect_503(call: object, rid: str) -> None:
    assert callable(call)
    with pytest.raises(openai.APIStatusError) as err:
        call()
    assert err.value.status_code == 503, (err.value.status_code, err.value.body)
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert rid in err.value.message and "unavailable" in err.value.message, err.value.message


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_response_on_a_down_replica_is_a_503_to_retry(
    stack: tuple[list[Proc], list[str], str], fault: str,
) -> None:
    sims, ids, base = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="remember this", max_output_tokens=4)
    made = raw.parse()
    home = ids.index(next(i for i in ids if raw.headers["x-kvgate-replica"].endswith(i)))
    sims[home].signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    wait_for(lambda: _down(base, ids[home]), timeout=30, what="its home found down")
    _expect_503(lambda: client.responses.retrieve(made.id), made.id)
    _expect_503(lambda: client.responses.create(
        model=MODEL, input="and now?", previous_response_id=made.id, max_output_tokens=4),
        made.id)
    # the other replica serves everything else; nothing stays counted anywhere
    assert client.responses.create(model=MODEL, input="other", max_output_tokens=4).id
    sims[home].signal(signal.SIGCONT)
    wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
             timeout=30, what="nothing in flight")
