"""A gateway without authentication that did not relay a stored response asks the replicas
where it is (`ReplicaSearch`). While the replica holding it is down, that search finds it
nowhere: the GET and a follow-up naming it now answer the 503 with `Retry-After` that the
gateway which relayed it answers (`home_out`), not a 404 saying the response is gone (and a
follow-up sent on to another replica, whose own 404 said the same).

Real gateways (two, no Redis: each keeps its own homes), two simulated replicas with the
store on, the official client; the home is frozen (SIGSTOP), then let go.
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
def stack() -> Iterator[tuple[list[Proc], list[str], str, str]]:
    procs: list[Proc] = []
    try:
        sims = [sim_proc(None, "--time-scale", "50", "--enable-store", model=MODEL)
                for _ in range(2)]
        for p, _ in sims:
            procs.append(p.start())
        bases = []
        for _ in range(2):
            gw, base = gateway_proc(upstreams=[u for _, u in sims], env=ENV)
            procs.append(gw.start())
            bases.append(base)
        yield ([p for p, _ in sims], [u.removeprefix("http://") for _, u in sims], bases[0],
               bases[1])
    finally:
        for p in reversed(procs):
            p.signal(signal.SIGCONT)
            p.stop()


def test_a_response_searched_for_while_its_home_is_down_is_a_503(
    stack: tuple[list[Proc], list[str], str, str],
) -> None:
    sims, ids, relayed_by, other = stack
    made_at = openai.OpenAI(base_url=f"{relayed_by}/v1", api_key="x", max_retries=0, timeout=10)
    client = openai.OpenAI(base_url=f"{other}/v1", api_key="x", max_retries=0, timeout=10)
    raw = made_at.responses.with_raw_response.create(
        model=MODEL, input="remember this", max_output_tokens=4)
    made = raw.parse()
    home = next(i for i, rid in enumerate(ids) if raw.headers["x-kvgate-replica"].endswith(rid))
    sims[home].signal(signal.SIGSTOP)
    wait_for(lambda: any(ids[home] in k and v == 0 for k, v in
                         metric_values(other, "kvgate_replica_healthy").items()),
             timeout=30, what="its home found down")
    def retrieve() -> object:
        return client.responses.retrieve(made.id)

    def follow_up() -> object:
        return client.responses.create(model=MODEL, input="and now?",
                                       previous_response_id=made.id, max_output_tokens=4)

    for call in (retrieve, follow_up):
        with pytest.raises(openai.APIStatusError) as err:
            call()
        assert err.value.status_code == 503, (err.value.status_code, err.value.body)
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert made.id in err.value.message, err.value.message
    # an id no replica holds, all of them answering, is still the 404
    sims[home].signal(signal.SIGCONT)
    wait_for(lambda: all(v == 1 for v in metric_values(other, "kvgate_replica_healthy").values()),
             timeout=30, what="its home back")
    assert client.responses.retrieve(made.id).id == made.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 32)
    wait_for(lambda: sum(metric_values(other, "kvgate_inflight_requests").values()) == 0,
             timeout=30, what="nothing in flight")
