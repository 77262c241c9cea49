"""A replica a policy write removes while it streams finishes its stream, and the admin API
shows it draining until its last request ends.

`GET /admin/replicas` listed a pool's current replicas only: one removed with a stream in
flight vanished from it at once, and an operator scaling down could not tell when its process
could be stopped without cutting a client (its streams still ran there). Now each pool lists
`draining`: the replicas that left it and still have requests in flight, in the replicas'
shape, until the last one ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.support.gateway import admin_client, gateway_proc, wait_for
from tests.support.procs import sim_proc

ADMIN = "replica-draining-admin-token-00"
MERGE = {"content-type": "application/merge-patch+json"}


# slow generation: the stream is still running after the policy write
_LONG = {"model": "llama", "stream": True, "max_tokens": 300, "ignore_eos": True,
         "messages": [{"role": "user", "content": "tell a long story"}]}


@contextmanager
def _streaming(
    pools: Callable[[str, str], dict[str, Any]],
) -> Iterator[tuple[list[str], httpx.Client, httpx.Response, Iterator[str], str]]:
    """Two slow simulators, a gateway with ``pools(url_a, url_b)`` serving model ``llama``
    from pool ``p``, and a long stream opened through it: (the urls, an admin client, the
    stream's response, its lines, its first event)."""
    sims = [sim_proc(None, "--time-scale", "1", model="m") for _ in range(2)]
    urls = [url for _, url in sims]
    config = {"pools": pools(*urls), "models": {"llama": {"default": "p"}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with sims[0][0], sims[1][0], gw, admin_client(base, ADMIN) as admin, \
            httpx.Client(timeout=60) as client, \
            client.stream("POST", f"{base}/v1/chat/completions", json=_LONG) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        yield urls, admin, resp, lines, first


def test_a_removed_replica_streams_on_and_shows_draining() -> None:
    with _streaming(lambda a, b: {"p": {"served_model": "m", "replicas": [a, b]}}) as (
            urls, admin, resp, lines, first):
        rid = resp.headers["x-kvgate-replica"].split("/", 1)[1]
        kept = next(u for u in urls if not u.endswith(rid.rsplit(":", 1)[1]))
        r = admin.patch("/policy", json={"pools": {"p": {"replicas": [kept]}}}, headers=MERGE)
        assert r.status_code == 200, r.text

        pool = admin.get("/replicas").json()["data"][0]
        assert [x["id"] for x in pool["replicas"]] == [kept.removeprefix("http://")]
        assert [(x["id"], x["inflight"]) for x in pool["draining"]] == [(rid, 1)]

        rest = [first, *(x for x in lines if x)]  # the stream goes on to its end
        chunks = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
        assert rest[-1] == "data: [DONE]"  # not cut: no error event, the end marker last
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        def drained() -> bool:
            return not admin.get("/replicas").json()["data"][0]["draining"]

        wait_for(drained, timeout=30, what="the removed replica drained")


def test_a_removed_pools_replica_shows_draining() -> None:
    """A policy write that removes a whole pool (a scale-down moving its model elsewhere): its
    replica, still streaming, was listed nowhere (only pools in force were), the very case
    the list is for."""
    with _streaming(lambda a, b: {"p": {"served_model": "m", "replicas": [a]},
                                  "q": {"served_model": "m", "replicas": [b]}}) as (
            (gone, _), admin, _, lines, _):
        r = admin.patch("/policy", json={"pools": {"p": None},
                                         "models": {"llama": {"default": "q"}}}, headers=MERGE)
        assert r.status_code == 200, r.text

        pools = {p["pool"]: p for p in admin.get("/replicas").json()["data"]}
        assert pools["p"]["removed"] is True and pools["p"]["replicas"] == []
        assert [x["id"] for x in pools["p"]["draining"]] == [gone.removeprefix("http://")]
        assert "removed" not in pools["q"]
        assert [x for x in lines if x][-1] == "data: [DONE]"  # the stream goes on to its end

        def drained() -> bool:
            return "p" not in {p["pool"] for p in admin.get("/replicas").json()["data"]}

        wait_for(drained, timeout=30, what="the removed pool's replica drained")
