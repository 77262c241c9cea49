"""A tier's band changed through the admin API while its requests wait in flow control's queue
applies to them: they take their place in the new band. They kept the band they were queued
in: a tier raised above another (an incident: its customers first) still had its waiting
requests released after the other tier's, while its new requests went first, past them.

One simulated replica whose streams hang after two tokens, ``flow.max_inflight: 1``, tiers
`lo` (band 5) and `hi` (band 1); a real gateway with authentication, the official openai
client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "flowacct-band-admin-token-0123456789"
ASK: dict[str, Any] = {"model": "llama", "max_tokens": 50, "stream": True,
                       "messages": [{"role": "user", "content": "hello"}]}


class Stream(threading.Thread):
    """One stream read to its end; its name goes into ``order`` at its first chunk."""

    def __init__(self, base: str, key: str, name: str, order: list[str]) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                    timeout=60)
        self.tag, self.order = name, order
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            for _ in self.client.chat.completions.create(**ASK):
                if self.tag not in self.order:
                    self.order.append(self.tag)
        except openai.APIError as exc:
            self.error = exc


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def test_a_band_changed_while_queued_applies_to_the_waiting_requests(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"lo": "p", "hi": "p"}},
              "tiers": {"lo": {"flow": {"band": 5}}, "hi": {"flow": {"band": 1}}},
              "tenants": [{"id": "low", "tier": "lo"}, {"id": "high", "tier": "hi"}],
              "flow": {"enabled": True, "max_inflight": 1}}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        low, high = (str(admin.post(f"/tenants/{t}/keys").json()["key"]) for t in ("low", "high"))
        body = {**ASK, "messages": [{"role": "user", "content": "fill"}]}
        http = httpx.Client(timeout=60)
        filler = http.send(http.build_request(
            "POST", f"{base}/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {high}"}), stream=True)
        chunks = filler.iter_raw()  # (kept: a generator collected closes the response)
        next(chunks)  # the replica's one seat is taken
        order: list[str] = []
        waiting_low = Stream(base, low, "low", order)
        waiting_low.start()
        wait_for(lambda: _depth(base) == 1, 20, "the low tier's request queued")
        waiting_high = Stream(base, high, "high", order)
        waiting_high.start()
        wait_for(lambda: _depth(base) == 2, 20, "the high tier's request queued")
        doc = admin.get("/policy").json()
        doc["tiers"]["lo"]["flow"]["band"] = 0  # the low tier goes first from now on
        assert admin.put("/policy", json=doc).status_code == 200
        # the streams from now on run to their end (the filler's stays hung until closed)
        httpx.post(f"{sim}/sim/faults", json={"hang_after_tokens": -1}, timeout=10)
        filler.close()
        http.close()  # its seat frees: the first of the queue takes it, then the other
        for stream in (waiting_low, waiting_high):
            stream.join(60)
            assert stream.error is None, stream.error
        assert order == ["low", "high"]
        wait_for(lambda: inflight(base) == 0 and _depth(base) == 0, 30, "nothing left")
