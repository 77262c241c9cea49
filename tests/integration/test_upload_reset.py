"""A replica that resets the connection while kvgate still uploads a large request body (it
died, or a proxy in front of it refused the upload): nothing reached the client, so another
replica answers; a pool's only replica gives the client a 502 saying the replica did not
answer, then the pool's 503 once it is ejected -- never a hang, a 500 or a traceback."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.bad_replica import BadReplica
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
PROMPT = "word " * 200_000  # 1 MB: uploaded in many writes


def _ask(base: str, i: int) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": f"{i} {PROMPT}", "max_tokens": 2})


def test_a_reset_upload_is_answered_by_another_replica(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", "--max-model-len", "500000",
                       "--num-gpu-blocks", "10000", model=MODEL)
    with BadReplica(MODEL) as bad:
        bad.reset_upload = True
        gw, base = gateway_proc(upstreams=[bad.url, sim],
                                env={"KVGATE_ROUTING__POLICY": "round_robin"})
        with gw:
            answers = [_ask(base, i) for i in range(4)]
    assert [r.status_code for r in answers] == [200] * 4
    assert {r.headers["x-kvgate-replica"] for r in answers} == {
        f"default/{sim.removeprefix('http://')}"}
    assert bad.posts >= 1  # it was tried


def test_a_lone_replica_resetting_uploads_is_a_502_then_the_pools_503() -> None:
    with BadReplica(MODEL) as bad:
        bad.reset_upload = True
        gw, base = gateway_proc(upstreams=[bad.url], env={
            "KVGATE_HEALTH__EJECT_BASE_S": "60", "KVGATE_HEALTH__EJECT_MAX_S": "60"})
        with gw:
            answers = [_ask(base, i) for i in range(3)]
    errors = [(r.status_code, r.json()["error"]["message"]) for r in answers]
    assert errors[0] == (502, "The replica did not answer.")
    assert errors[-1][0] == 503 and "ejected after failed requests" in errors[-1][1]
    assert answers[-1].headers["retry-after"].isdigit()
