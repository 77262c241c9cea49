"""The picker's destination list and the data plane's subset hint, through a real Envoy whose
cluster uses Envoy's ``override_host`` policy (it takes the whole list and walks it on
retries). The subset hint is copied from a test header into ``envoy.lb.subset_hint`` filter
metadata by Envoy's header_to_metadata filter, as a gateway would set it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from openai._legacy_response import LegacyAPIResponse
from openai.types.chat import ChatCompletion

from tests.support.epp import envoy_proc, epp_proc
from tests.support.procs import Proc, start_sims

MODEL = "sim-model"
SUBSET = "x-test-subset"


@dataclass
class Stack:
    envoy: str
    sims: list[Proc]
    urls: list[str]

    def ask(self, content: str, subset: str | None = None) -> httpx.Response:
        headers = {SUBSET: subset} if subset is not None else {}
        return httpx.post(f"{self.envoy}/v1/chat/completions", headers=headers, timeout=10,
                          json={"model": MODEL, "max_tokens": 2,
                                "messages": [{"role": "user", "content": content}]})


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        sims, urls = start_sims(procs, 3, "--time-scale", "20", model=MODEL)
        # slow health polling: the picker learns that a replica died from Envoy, not a probe
        config = {"pools": {"default": {"served_model": MODEL, "replicas": urls}},
                  "epp": {"fallbacks": 2},
                  "health": {"interval_s": 60, "failure_threshold": 5}}
        epp = epp_proc(config=config)
        procs.append(epp.start())
        endpoints = [u.removeprefix("http://") for u in urls]
        envoy, base = envoy_proc(epp.picker, endpoints=endpoints, subset_header=SUBSET)
        procs.append(envoy.start())
        yield Stack(base, sims, urls)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _replica(resp: httpx.Response | LegacyAPIResponse[ChatCompletion]) -> str:
    return resp.headers["x-kvgate-replica"].removeprefix("default/")


def test_the_subset_hint_is_respected(stack: Stack) -> None:
    eps = [u.removeprefix("http://") for u in stack.urls]
    for n in range(6):
        resp = stack.ask(f"only the first {n}", subset=eps[0])
        assert resp.status_code == 200 and _replica(resp) == eps[0]
    seen = set()
    for n in range(12):
        resp = stack.ask(f"two of three {n}", subset=f"{eps[1]},{eps[2]}")
        assert resp.status_code == 200
        seen.add(_replica(resp))
    assert seen <= {eps[1], eps[2]}
    foreign = stack.ask("nowhere", subset="10.255.255.1:8000")
    assert foreign.status_code == 503
    assert foreign.json()["error"]["type"] == "ServiceUnavailableError"


def test_a_dead_first_choice_falls_back_to_the_next_endpoint(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.envoy}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "system", "content": "pinned " * 400},
                     {"role": "user", "content": "first"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2)
    raw.parse()
    home = _replica(raw)
    dead = next(p for p, u in zip(stack.sims, stack.urls, strict=True) if u.endswith(home))
    dead.kill()  # the picker does not know yet (no probe for a minute)
    messages[-1] = {"role": "user", "content": "second"}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2)
    answer = raw.parse()
    assert answer.choices[0].message.content
    assert _replica(raw) != home  # Envoy moved down the list to a live endpoint
    assert raw.headers["x-kvgate-route"] == "retry"
