"""A pool a policy version switches from listed replicas to discovery, through the admin API of
a real gateway: its replicas come from discovery only, as the document says. Until discovery
has synced they are kept (at most the 5 s start-up waits for a first sync), then dropped:
a discovery that never syncs (its API server unreachable, a wrong Service) leaves the pool
empty and /readyz saying so, as a gateway started with it does.

Before: the listed replicas were kept until discovery published, forever when it never
did -- the pool served from replicas its policy no longer names, /readyz ready, and nothing
said discovery had not listed anything."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support.gateway import admin_client, gateway_proc, wait_for
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "switch-admin-token-0123456789"


def _status(c: openai.OpenAI) -> tuple[int, str]:
    """(status, the replica that answered or the error's message) of one small completion."""
    try:
        raw = c.completions.with_raw_response.create(model="m", prompt="x", max_tokens=2)
        return raw.status_code, "http://" + raw.headers["x-kvgate-replica"].partition("/")[2]
    except openai.APIStatusError as exc:
        return exc.status_code, exc.message


def test_a_pool_switched_to_discovery_drops_its_listed_replicas(sim_factory: SimFactory) -> None:
    _, listed = sim_factory("--time-scale", "50", model="m")
    _, found = sim_factory("--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [listed]}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)

        def put(pool: dict[str, Any]) -> None:
            current = admin.get("/policy")
            doc = current.json()
            doc["pools"]["p"] = {"served_model": "m", **pool}
            resp = admin.put("/policy", json=doc, headers={"If-Match": current.headers["etag"]})
            assert resp.status_code == 200, resp.text

        assert _status(c) == (200, listed)
        # an API server nothing listens at: discovery never syncs
        put({"discovery": {"kubernetes": {
            "service": "vllm", "namespace": "d", "api_server": f"http://127.0.0.1:{free_port()}",
            "backoff_max_seconds": 1}}})
        wait_for(lambda: _status(c)[0] == 503, timeout=20, what="the listed replica dropped")
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 503 and "no replica listed or discovered" in ready.text
        pools = admin.get("/replicas").json()["data"]
        assert [p["replicas"] for p in pools if p["pool"] == "p"] == [[]], pools

        # a discovery that syncs: its replica serves (DNS: localhost at the replica's port)
        put({"discovery": {"dns": {"name": "localhost", "port": int(found.rsplit(":", 1)[1]),
                                   "interval_seconds": 0.2}}})
        wait_for(lambda: _status(c) == (200, found), timeout=20, what="the discovered replica")
        # another mapping whose source cannot sync: the last set found is kept (an API
        # outage empties no pool), past the 5 s a switch from a list is given
        put({"discovery": {"kubernetes": {
            "service": "vllm", "namespace": "d", "api_server": f"http://127.0.0.1:{free_port()}",
            "backoff_max_seconds": 1}}})
        time.sleep(7)
        assert _status(c) == (200, found)
        # and back to a list
        put({"replicas": [listed]})
        wait_for(lambda: _status(c) == (200, listed), timeout=20, what="the listed replica")


def test_a_pool_started_with_both_serves_only_what_discovery_lists(
    sim_factory: SimFactory,
) -> None:
    """A pool with `replicas` and `discovery` at start-up: "those pools start empty" was
    logged when discovery had not synced in 5 s, and the listed replicas served on."""
    _, listed = sim_factory("--time-scale", "50", model="m")
    unreachable = {"kubernetes": {"service": "vllm", "namespace": "d",
                                  "api_server": f"http://127.0.0.1:{free_port()}"}}
    config = {"pools": {"p": {"served_model": "m", "replicas": [listed],
                              "discovery": unreachable}}}
    gw, base = gateway_proc(config=config, ready=False)
    with gw:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)
        wait_for(lambda: httpx.get(f"{base}/readyz").status_code != 404, what="the lifespan")
        status, said = _status(c)
        assert status == 503, said
        assert "no replica listed or discovered" in httpx.get(f"{base}/readyz").text
