"""A pool a policy version switches from listed replicas to a discovery that never syncs drops
its listed replicas after the 5 s a first sync is given, also when another policy version
(one that changes something else: a tier, a model name) comes meanwhile.

Before: the drop was skipped when any later version was in force by then, and that version
was no switch itself (its pool had discovery already): the listed replicas served on for good,
/readyz ready, from replicas the policy no longer names -- what the switch meant to end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support.gateway import admin_client, gateway_proc, wait_for
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "overtaken-admin-token-0123456789"


def test_a_switch_overtaken_by_an_unrelated_version_still_drops_the_listed_replicas(
    sim_factory: SimFactory,
) -> None:
    _, listed = sim_factory("--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [listed]}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)

        def put(change: Callable[[dict[str, Any]], None]) -> None:
            current = admin.get("/policy")
            doc = current.json()
            change(doc)
            resp = admin.put("/policy", json=doc, headers={"If-Match": current.headers["etag"]})
            assert resp.status_code == 200, resp.text

        def switch(doc: dict[str, Any]) -> None:  # an API server nothing listens at
            doc["pools"]["p"] = {"served_model": "m", "discovery": {"kubernetes": {
                "service": "vllm", "namespace": "d",
                "api_server": f"http://127.0.0.1:{free_port()}", "backoff_max_seconds": 1}}}

        def alias(doc: dict[str, Any]) -> None:  # another public name for the same pool
            doc["models"]["m-alias"] = {"default": "p"}

        assert c.completions.with_raw_response.create(
            model="m", prompt="x", max_tokens=2).status_code == 200
        put(switch)
        put(alias)  # well within the 5 s
        wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 503, timeout=20,
                 what="the listed replica dropped")
        assert "no replica listed or discovered" in httpx.get(f"{base}/readyz").text
        pools = admin.get("/replicas").json()["data"]
        assert [p["replicas"] for p in pools if p["pool"] == "p"] == [[]], pools
