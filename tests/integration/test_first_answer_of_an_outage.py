"""The first request after a pool's only replica went away gets the answer the following ones
get: 503 `ServiceUnavailableError` saying why (counted, no address) with `Retry-After`, not a
502 "did not answer" that only it sees. Real simulator (killed), real gateway, the official
openai client; no counter left behind."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, inflight, metric_values
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
# probes far apart: only the requests themselves can find the replica gone
SLOW_HEALTH = {"interval_s": 60, "timeout_s": 0.5, "failure_threshold": 2,
               "eject_base_s": 5, "eject_max_s": 30}


def _error(client: openai.OpenAI, stream: bool) -> tuple[int, str | None, dict[str, object]]:
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=stream)
    resp = caught.value.response
    return resp.status_code, resp.headers.get("retry-after"), resp.json()["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_first_request_of_an_outage_is_answered_as_the_next_ones(
    sim_factory: SimFactory, stream: bool,
) -> None:
    sim, url = sim_factory()
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": [url]}},
              "models": {"m": {"default": "p"}}, "health": SLOW_HEALTH}
    gw, base = gateway_proc(config=config)
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        sim.kill()
        answers = [_error(client, stream) for _ in range(3)]
        assert answers[0] == answers[1] == answers[2], answers
        status, retry_after, error = answers[0]
        assert status == 503 and retry_after is not None and int(retry_after) >= 1
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert "No healthy replica for the model `m` (1 replica: cannot connect)" in str(
            error["message"])
        assert "127.0.0.1" not in str(error["message"])
        assert inflight(base) == 0


def test_a_refused_try_with_another_replica_left_is_answered_by_it(
    sim_factory: SimFactory,
) -> None:
    """The 503 is for a pool left with nothing: with a live replica the request is served."""
    dead, dead_url = sim_factory()
    _, live_url = sim_factory("--time-scale", "50")
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": [dead_url, live_url]}},
              "models": {"m": {"default": "p"}}, "health": SLOW_HEALTH}
    gw, base = gateway_proc(config=config, args=["--policy", "round_robin"])
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        dead.kill()
        for _ in range(3):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert inflight(base) == 0


def _set_dead(sim: str) -> None:
    httpx.post(f"{sim}/sim/faults", json={"dead": True}).raise_for_status()


@pytest.mark.parametrize("stream", [False, True])
def test_the_first_request_of_an_engine_outage_is_answered_as_the_next_ones(
    sim_factory: SimFactory, stream: bool,
) -> None:
    """Every replica's engine died (vLLM 0.34: each answers 500 "The server had an error
    while processing your request." until its server exits): the request whose last try
    met a dead engine gets the pool's 503 with Retry-After, as the ones after it, not the
    last engine's 500 that only it sees."""
    (_, a), (_, b) = sim_factory(), sim_factory()
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": [a, b]}},
              "models": {"m": {"default": "p"}}, "health": SLOW_HEALTH}
    gw, base = gateway_proc(config=config, args=["--policy", "round_robin"])
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        _set_dead(a)
        _set_dead(b)
        answers = [_error(client, stream) for _ in range(3)]
        assert answers[0] == answers[1] == answers[2], answers
        status, retry_after, error = answers[0]
        assert status == 503 and retry_after is not None and int(retry_after) >= 1
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert "No healthy replica for the model `m` (2 replicas: 2 its engine died (500))" in str(
            error["message"]), error
        assert inflight(base) == 0


def test_a_dead_engine_met_by_the_last_try_with_replicas_left_is_a_502(
    sim_factory: SimFactory,
) -> None:
    """One try per request (`upstream.max_attempts: 1`): the request that meets the dead
    engine gets a 502 saying so (retried by the SDKs), not the engine's 500 as if the
    request had failed; the replica is down from then on and the next ones are served."""
    (_, dead), (_, live) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": [dead, live]}},
              "models": {"m": {"default": "p"}}, "health": SLOW_HEALTH,
              "upstream": {"max_attempts": 1}}
    gw, base = gateway_proc(config=config, args=["--policy", "round_robin"])
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        _set_dead(dead)
        failed = []
        for _ in range(4):
            try:
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            except openai.APIStatusError as exc:
                failed.append((exc.status_code, exc.response.json()["error"]))
        assert len(failed) == 1, failed
        status, error = failed[0]
        assert status == 502 and error["type"] == "BadGatewayError", failed
        assert "engine died" in str(error["message"])
        assert inflight(base) == 0


@pytest.mark.parametrize("dead", [True, False], ids=["engines-died", "servers-gone"])
def test_the_first_request_of_an_outage_is_charged_no_output_by_flow_control(
    sim_factory: SimFactory, dead: bool,
) -> None:
    """Flow control charges a request its prompt and expected output when it sends it on,
    and gives back what never ran when it is over. The first request of an outage (its tries
    met dead engines, or nothing listening) ran nothing, as the next ones that the pool's 503
    refuses at once: it kept its whole charge (1000 output tokens here) in the tenant's
    fair-share standing and the served-tokens count."""
    (sim_a, a), (sim_b, b) = sim_factory(), sim_factory()
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": [a, b]}},
              "models": {"m": {"default": "p"}}, "health": SLOW_HEALTH,
              "flow": {"enabled": True}}
    gw, base = gateway_proc(config=config)
    with gw:
        for url, proc in ((a, sim_a), (b, sim_b)):
            if dead:
                _set_dead(url)
            else:
                proc.stop()
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000})
        assert resp.status_code == 503, resp.text
        served = sum(metric_values(base, "kvgate_flow_served_tokens_total").values())
        assert served < 100, served  # its prompt at most (a few tokens)
        assert inflight(base) == 0
