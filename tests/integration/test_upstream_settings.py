"""Upstream settings docs/configuration.md documents, through a real gateway and simulated vLLM
replicas: a pool's `api_key_env` (vLLM's `--api-key`, sent upstream instead of the client's
credentials) and `upstream.total_timeout_s` (the whole exchange, however steadily the replica
streams)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import yaml

from tests.support.gateway import FAST_HEALTH, gateway_proc, inflight, wait_for
from tests.support.procs import KVGATE, ROOT, Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
MODEL = "sim-model"
VLLM_KEY = "vllm-api-key-0123456789"


def sent_headers(sim: str, request_id: str) -> dict[str, str]:
    for item in httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"]:
        if item["headers"].get("x-request-id") == request_id:
            headers: dict[str, str] = item["headers"]
            return headers
    raise AssertionError(f"request {request_id} never reached {sim}")


def test_api_key_env_is_sent_to_the_replica_instead_of_the_clients_key(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "50", "--api-key", VLLM_KEY)  # vLLM --api-key
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [sim],
                              "api_key_env": "TEST_POOL_VLLM_KEY"}}}
    gw, base = gateway_proc(config=config, env={"TEST_POOL_VLLM_KEY": VLLM_KEY})
    with gw:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="the-clients-own-key", max_retries=0,
                          timeout=30)
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.status_code == 200 and raw.parse().choices[0].message.content
        headers = sent_headers(sim, raw.headers["x-request-id"])
        assert headers["authorization"] == f"Bearer {VLLM_KEY}"
        streamed = c.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)


def test_without_the_pools_key_the_replica_refuses(sim_factory: SimFactory) -> None:
    """The other side of the test above: the replica does check the key. Its 401 is about
    the gateway's credentials, not the client's (whose key the gateway accepted): the client
    gets a 502 saying so, and the replica is taken out (every request would fail there)."""
    _, sim = sim_factory("--time-scale", "50", "--api-key", VLLM_KEY)
    # marked down until /health answers again (it needs no key): no probe after the one at
    # start, or the next (every 0.2 s) puts it back before a slow machine reads /readyz
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [sim],
                              "api_key_env": "TEST_POOL_VLLM_KEY"}},
              "health": {**FAST_HEALTH, "interval_s": 60}}
    gw, base = gateway_proc(config=config, env={"TEST_POOL_VLLM_KEY": "a-wrong-key"})
    with gw:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=VLLM_KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as err:  # not AuthenticationError
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                      max_tokens=2)
        assert err.value.status_code == 502
        body = err.value.response.json()["error"]
        assert body["type"] == "BadGatewayError" and body["code"] == 502
        assert "refused the gateway's credentials" in body["message"]
        assert "a-wrong-key" not in err.value.response.text
        assert err.value.response.headers["x-should-retry"] == "false"  # SDK: no retry
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 503  # taken out
        assert "refused the gateway's credentials" in gw.output()  # the operator is told


def test_quick_form_says_why_a_keyed_replica_is_never_ready(sim_factory: SimFactory) -> None:
    """`--upstream` learns the pool's model from /v1/models, which vLLM's --api-key guards:
    without the key the pool never gets ready, and the log says why (once)."""
    _, sim = sim_factory("--time-scale", "50", "--api-key", VLLM_KEY)
    gw, base = gateway_proc(upstreams=[sim], ready=False)
    with gw:
        wait_for(lambda: "refused the gateway's credentials" in gw.output(), timeout=30,
                 what="the warning")
        assert httpx.get(f"{base}/readyz", timeout=5).status_code == 503
        time.sleep(1.0)  # five more health polls (0.2 s apart): not one warning each
        assert gw.output().count("refused the gateway's credentials") == 1


def test_total_timeout_cuts_a_stream_that_never_goes_idle(sim_factory: SimFactory) -> None:
    # real time: a token every few ms, so neither the first-byte nor the idle timeout fires
    _, sim = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[sim], env={
        "KVGATE_UPSTREAM__TOTAL_TIMEOUT_S": "1.5", "KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "5",
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "5"})
    with gw:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 20000, "ignore_eos": True,
                "stream": True}
        t0 = time.monotonic()
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                assert time.monotonic() - t0 < 15, "the total timeout did not cut the stream"
        took = time.monotonic() - t0
        assert 1.4 < took < 10, took
        assert len(events) > 20  # it was streaming steadily when the total timeout fired
        assert events[-1] == "data: [DONE]"
        error = orjson.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 504 and "total timeout" in error["message"], error
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_total_timeout_bounds_a_whole_answer(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[sim], env={
        "KVGATE_UPSTREAM__TOTAL_TIMEOUT_S": "1.5", "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "60"})
    with gw:
        t0 = time.monotonic()
        resp = httpx.post(f"{base}/v1/completions", timeout=15, json={
            "model": MODEL, "prompt": "x", "max_tokens": 20000, "ignore_eos": True})
        took = time.monotonic() - t0
        assert resp.status_code == 504, resp.text
        assert "total timeout" in resp.json()["error"]["message"]
        assert 1.4 < took < 10, took


@pytest.mark.parametrize("command", ["serve", "epp"])
def test_a_pool_key_variable_that_is_not_set_stops_the_start(
    command: str, tmp_path: Path
) -> None:
    # without it every request would reach vLLM without its key and come back 401, while
    # /health (not behind vLLM's key) said the replicas were fine
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({"pools": {"p": {
        "served_model": MODEL, "replicas": ["http://127.0.0.1:9"],
        "api_key_env": "TEST_POOL_KEY_NEVER_SET"}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    result = subprocess.run(
        [*KVGATE, command, "--no-auth", "--config", str(path), "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 2, result.stderr
    assert "pools.p.api_key_env" in result.stderr
    assert "TEST_POOL_KEY_NEVER_SET" in result.stderr and "Traceback" not in result.stderr
