"""A replica its requests ejected says why where an operator looks: `reason` in `GET
/admin/replicas` (and so /readyz and the doctor, which read the same field).

A replica answering /health 200 but vLLM's 500 to every request was ejected (its clients'
requests retried on the other replica: all 200), logged once, but `GET /admin/replicas`
showed it `ejected` with `reason: null` for as long as it stayed out: nothing told the
operator looking there why.
"""

from __future__ import annotations

import httpx
import openai

from tests.support.gateway import admin_client, gateway_proc, wait_for
from tests.support.procs import sim_proc

ADMIN = "replica-ejection-reason-token-0"
# ejected for 60 s at least: still out when the test looks
HEALTH = {"interval_s": 0.2, "timeout_s": 2.0, "failure_threshold": 2,
          "eject_base_s": 60.0, "eject_max_s": 60.0}


def test_a_replica_its_requests_ejected_says_why() -> None:
    bad, bad_url = sim_proc(None, "--time-scale", "50", "--error-rate", "1.0",
                            "--error-status", "500", model="m")
    good, good_url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [bad_url, good_url]}},
              "models": {"llama": {"default": "p"}}, "health": HEALTH}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with bad, good, gw, admin_client(base, ADMIN) as admin:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        bad_id = bad_url.removeprefix("http://")

        def state() -> dict[str, object]:
            replicas = admin.get("/replicas").json()["data"][0]["replicas"]
            found: dict[str, object] = next(r for r in replicas if r["id"] == bad_id)
            return found

        sent = iter(range(10**6))

        def ejected() -> bool:
            # a new prompt each time: one prompt, its tie between two idle replicas broken
            # the same way every time, could go to the good replica alone and never eject
            raw = client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": f"hi {next(sent)}"}],
                max_tokens=2)
            assert raw.status_code == 200  # tried on the other replica
            return state()["state"] == "ejected"

        wait_for(ejected, timeout=60, what="the failing replica ejected")
        reason = state()["reason"]
        assert isinstance(reason, str) and "requests failed" in reason, reason
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200  # the pool serves
