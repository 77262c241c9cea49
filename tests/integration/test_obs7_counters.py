"""Two counters operators lacked, read from a real gateway's /metrics over HTTP:

- `kvgate_api_requests_total{pool,api,status}`: traffic per API (chat, Anthropic's messages,
  tokenize, ...), a fixed name per route, never the path; `kvgate_requests_total` keeps its
  labels (its `route` is the router's reason, which dashboards read);
- `kvgate_stored_response_unavailable_total{pool,replica,reason}`: Responses API requests for
  a response stored on a replica that is down, answered 503.

Real gateway, simulated replicas, the official openai and anthropic clients."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

anthropic: Any = pytest.importorskip("anthropic", reason="run scripts/setup (test extra)")

MODEL = "sim-model"
ENV = {"KVGATE_HEALTH__INTERVAL_S": "0.3", "KVGATE_HEALTH__TIMEOUT_S": "0.5",
       "KVGATE_ROUTING__POLICY": "round_robin"}


@pytest.fixture
def stack() -> Iterator[tuple[list[Proc], list[str], str]]:
    procs: list[Proc] = []
    try:
        sims = [sim_proc(None, "--time-scale", "50", "--enable-store", model=MODEL)
                for _ in range(2)]
        for p, _ in sims:
            procs.append(p.start())
        gw, base = gateway_proc(upstreams=[u for _, u in sims], env=ENV)
        procs.append(gw.start())
        yield [p for p, _ in sims], [u.removeprefix("http://") for _, u in sims], base
    finally:
        for p in reversed(procs):
            p.stop()


def _labels(key: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.strip("{}").replace('"', "").split(","))


def _per_api(base: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for key, v in metric_values(base, "kvgate_api_requests_total").items():
        lb = _labels(key)
        out[(lb["api"], lb["status"])] = out.get((lb["api"], lb["status"]), 0.0) + v
    return out


def test_requests_are_counted_per_api_by_name(
    stack: tuple[list[Proc], list[str], str],
) -> None:
    _, _, base = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    ac = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    ac.messages.create(model=MODEL, max_tokens=4,
                       messages=[{"role": "user", "content": "hello"}])
    tok = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "count me"},
                     timeout=10)
    assert tok.status_code == 200, tok.text
    for _ in range(2):
        client.embeddings.create(model=MODEL, input="embed me")
    wait_for(lambda: sum(_per_api(base).values()) >= 6, timeout=10, what="6 counted")
    assert _per_api(base) == {("chat", "200"): 1.0, ("chat", "404"): 1.0,
                              ("messages", "200"): 1.0, ("tokenize", "200"): 1.0,
                              ("embeddings", "200"): 2.0}
    refused = [_labels(k) for k in metric_values(base, "kvgate_api_requests_total")
               if '"404"' in k]
    assert [lb["pool"] for lb in refused] == ["none"]  # refused before routing
    # the request counter keeps its labels: `route` is still the router's reason
    routes = {_labels(k)["route"] for k in metric_values(base, "kvgate_requests_total")}
    assert routes == {"round-robin", "none"}


def test_a_stored_response_on_a_down_replica_is_counted(
    stack: tuple[list[Proc], list[str], str],
) -> None:
    sims, ids, base = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="remember this", max_output_tokens=4)
    made = raw.parse()
    home = next(i for i, rid in enumerate(ids) if raw.headers["x-kvgate-replica"].endswith(rid))
    assert not metric_values(base, "kvgate_stored_response_unavailable_total")
    sims[home].signal(signal.SIGKILL)
    wait_for(lambda: any(ids[home] in k and v == 0
                         for k, v in metric_values(base, "kvgate_replica_healthy").items()),
             timeout=30, what="its home found down")
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.retrieve(made.id)
    assert err.value.status_code == 503
    with pytest.raises(openai.APIStatusError) as err:
        client.responses.create(model=MODEL, input="and now?", previous_response_id=made.id,
                                max_output_tokens=4)
    assert err.value.status_code == 503
    counted = metric_values(base, "kvgate_stored_response_unavailable_total")
    assert [(_labels(k), v) for k, v in counted.items()] == [
        ({"pool": "default", "replica": ids[home], "reason": "down"}, 2.0)], counted
