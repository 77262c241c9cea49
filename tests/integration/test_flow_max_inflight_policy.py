"""A pool's in-flight bound is policy: changed through the admin API while requests queue.

``flow.max_inflight`` is read from the configuration at start; an operator who set it below
the replicas' real ``--max-num-seqs`` had to restart every gateway, their queues answered 503
meanwhile, to let more through (the admin API refused any ``flow`` field). Now
``pools.<p>.max_inflight`` in the policy overrides it for that pool: a PATCH raising it
releases the requests queued behind the old bound at once, one lowering it queues new ones.
One gateway, one simulated replica whose streams hang, the official openai client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

ADMIN = "flow-max-inflight-admin-token-0123456789"


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def _taken(sim: str) -> int:
    items = httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"]
    return sum(1 for r in items if r["path"] == "/v1/chat/completions")


class Stream(threading.Thread):
    """A stream that holds its seat (the replica hangs after two tokens) until closed."""

    def __init__(self, base: str, key: str) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                    timeout=60)
        self.route: str | None = None
        self.first = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with self.client.chat.completions.with_streaming_response.create(
                    model="llama", stream=True, max_tokens=50,
                    messages=[{"role": "user", "content": "hold"}]) as resp:
                self.route = resp.headers.get("x-kvgate-route")
                for _ in resp.iter_lines():
                    self.first.set()
                    if self.stop.is_set():
                        break
        except Exception:  # the transport's own error types vary
            if not self.stop.is_set():  # (closed by the test: expected)
                raise

    def close(self) -> None:
        self.stop.set()
        self.client.close()


@pytest.fixture
def gateway(sim_factory: Callable[..., tuple[Proc, str]]) -> Iterator[tuple[str, str, str]]:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "flow": {"enabled": True, "max_inflight": 1}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    proc, base = gateway_proc(config=config, env=env, auth=True)
    with proc, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "t", "tier": "default"}).status_code == 201
        yield base, sim, str(admin.post("/tenants/t/keys").json()["key"])


def _patch(base: str, bound: int | None) -> None:
    with admin_client(base, ADMIN) as admin:
        resp = admin.patch("/policy", json={"pools": {"p": {"max_inflight": bound}}},
                           headers={"content-type": "application/merge-patch+json"})
        assert resp.status_code == 200, resp.text


def test_raising_the_bound_releases_the_queue_and_lowering_it_queues(
        gateway: tuple[str, str, str]) -> None:
    base, sim, key = gateway
    streams = [Stream(base, key) for _ in range(3)]
    try:
        streams[0].start()
        assert streams[0].first.wait(30)
        for s in streams[1:]:
            s.start()
        wait_for(lambda: _depth(base) == 2, 20, "two streams to queue behind the bound of 1")
        _patch(base, 3)
        wait_for(lambda: _taken(sim) == 3, 20, "the queued streams to be released")
        assert _depth(base) == 0
        _patch(base, 2)  # three in flight: a new one waits
        late = Stream(base, key)
        streams.append(late)
        late.start()
        wait_for(lambda: _depth(base) == 1, 20, "a new stream to queue behind the bound of 2")
        assert _taken(sim) == 3
        _patch(base, None)  # back to the configuration's bound (1): still full
        assert _depth(base) == 1
        with admin_client(base, ADMIN) as admin:
            for bad in (0, True, "4"):
                resp = admin.patch("/policy", json={"pools": {"p": {"max_inflight": bad}}})
                assert resp.status_code == 400
                assert resp.json()["error"]["param"] == "pools.p.max_inflight"
    finally:
        for s in streams:
            s.close()
