"""Flow control and a tier's spill-over for load: tier resolution spills when every replica
of the home pool is at the tier's `spill_when` levels, which it reads from the replicas'
scraped /metrics only; flow control's rule for room also counts the requests kvgate itself
has in flight there. A spill pool full by flow control's rule (its in-flight bound reached,
its scraped queue empty) took the request into its queue while the home pool had room: it
waited there until a request of the spill pool ended. It goes home now, as flow control's
own spill-over sends a request only to a pool with room. A real gateway, two simulated
replicas, the official openai client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


class Filler(threading.Thread):
    """A long stream of ``model`` that holds a seat of its replica until halted."""

    def __init__(self, base: str, model: str) -> None:
        super().__init__(daemon=True)
        self.base, self.model = base, model
        self.halt = threading.Event()

    def run(self) -> None:
        body = {"model": self.model, "stream": True, "max_tokens": 4000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "fill"}]}
        with httpx.Client(timeout=60) as c, c.stream(
                "POST", f"{self.base}/v1/chat/completions", json=body) as resp:
            for _ in resp.iter_raw():
                if self.halt.is_set():
                    return


def _pool_value(base: str, name: str, pool: str) -> float:
    return sum(v for k, v in metric_values(base, name).items() if f'pool="{pool}"' in k)


def test_a_request_stays_home_when_the_spill_pool_has_no_room(sim_factory: SimFactory) -> None:
    _, home = sim_factory("--time-scale", "1", "--max-num-seqs", "2")
    _, spill = sim_factory("--time-scale", "1")
    config = {"pools": {"h": {"served_model": "sim-model", "replicas": [home]},
                        "s": {"served_model": "sim-model", "replicas": [spill]}},
              "models": {"m": {"default": "h"}},
              "tiers": {"default": {"spill_to": "s",
                                    "spill_when": {"waiting": 1, "kv_usage": 0.95}}},
              "routing": {"scrape_interval_ms": 50},
              "flow": {"enabled": True, "max_inflight": 4, "tick_ms": 5}}
    gw, base = gateway_proc(config=config)
    # h: 2 running, 1 in its engine's queue (the tier's spill level); then s, where the
    # next ones spill: up to flow control's in-flight bound, its engine's queue empty
    fillers = [Filler(base, "m") for _ in range(7)]
    answer: dict[str, Any] = {}

    def ask() -> None:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        answer["replica"] = raw.headers["x-kvgate-replica"]
        answer["route"] = raw.headers["x-kvgate-route"]

    with gw:
        try:
            for i, f in enumerate(fillers):
                f.start()
                time.sleep(0.15)
                if i == 2:
                    wait_for(lambda: _pool_value(base, "kvgate_replica_waiting", "h") >= 1,
                             10, "h's engine queueing")
            wait_for(lambda: _pool_value(base, "kvgate_inflight_requests", "s") == 4, 10,
                     "s at its in-flight bound")
            wait_for(lambda: metric_values(base, "kvgate_flow_saturated").get(
                '{pool="s"}') == 1.0, 10, "pool s full by flow control's rule")
            # h is at the tier's spill level (one waiting in its engine) and has room
            assert _pool_value(base, "kvgate_replica_waiting", "h") >= 1
            assert metric_values(base, "kvgate_flow_saturated").get('{pool="h"}') == 0.0
            asker = threading.Thread(target=ask)
            asker.start()
            wait_for(lambda: _pool_value(base, "kvgate_inflight_requests", "h") == 4
                     or _pool_value(base, "kvgate_flow_queue_depth", "s") == 1, 10,
                     "the request sent or queued")
        finally:
            for f in fillers:
                f.halt.set()
            for f in fillers:
                f.join(30)
        asker.join(30)
    assert answer == {"replica": f"h/{home.removeprefix('http://')}", "route": answer.get(
        "route")}, answer
    assert answer["route"] != "spill", answer


class Direct(Filler):
    """A long stream sent to a replica directly (another client of it): its engine's queue
    grows with nothing of kvgate's in flight there."""

    def run(self) -> None:
        body = {"model": "sim-model", "stream": True, "max_tokens": 4000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "direct"}]}
        with httpx.Client(timeout=60) as c, c.stream(
                "POST", f"{self.base}/v1/chat/completions", json=body) as resp:
            for _ in resp.iter_raw():
                if self.halt.is_set():
                    return


def test_a_request_released_by_its_pool_goes_there(sim_factory: SimFactory) -> None:
    """A request queued in its home pool (full, both pools full) is released when home has
    room again; planned anew then, tier resolution spilled it for load (home's engine queue
    at `spill_when`, from other clients) to the spill pool, which had no room: it went there,
    past flow control's bound, counted in home's. It goes where it was released."""
    _, home = sim_factory("--time-scale", "1", "--max-num-seqs", "2")
    _, spill = sim_factory("--time-scale", "1")
    config = {"pools": {"h": {"served_model": "sim-model", "replicas": [home]},
                        "s": {"served_model": "sim-model", "replicas": [spill]}},
              "models": {"m": {"default": "h"}},
              "tiers": {"default": {"spill_to": "s",
                                    "spill_when": {"waiting": 1, "kv_usage": 0.95}}},
              "routing": {"scrape_interval_ms": 50},
              "flow": {"enabled": True, "max_inflight": 2, "tick_ms": 5}}
    gw, base = gateway_proc(config=config)
    fillers = [Filler(base, "m") for _ in range(4)]  # h: 2 (full); then s: 2 (full)
    direct = [Direct(home, "") for _ in range(2)]  # h's engine: both wait behind the fillers
    answer: dict[str, Any] = {}

    def ask() -> None:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        answer["replica"] = raw.headers["x-kvgate-replica"]

    with gw:
        try:
            for f in fillers:
                f.start()
                time.sleep(0.15)
            wait_for(lambda: metric_values(base, "kvgate_flow_saturated") == {
                '{pool="h"}': 1.0, '{pool="s"}': 1.0}, 10, "both pools full")
            asker = threading.Thread(target=ask)
            asker.start()
            wait_for(lambda: _pool_value(base, "kvgate_flow_queue_depth", "h") == 1, 10,
                     "the request queued in h")
            for d in direct:
                d.start()
            wait_for(lambda: _pool_value(base, "kvgate_replica_waiting", "h") >= 2, 10,
                     "h's engine queueing")
            fillers[0].halt.set()  # h has room (by flow control's rule) again
            wait_for(lambda: _pool_value(base, "kvgate_flow_queue_depth", "h") == 0, 10,
                     "the request released")
        finally:
            for f in [*fillers, *direct]:
                f.halt.set()
            for f in [*fillers, *direct]:
                f.join(30)
        asker.join(30)
    assert answer == {"replica": f"h/{home.removeprefix('http://')}"}, answer
