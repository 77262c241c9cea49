"""The first-byte timeout is per try: a replica that takes a stream and then sends nothing (a
hung engine) is dropped after `upstream.first_byte_timeout_s` and another replica answers,
with real simulators, a real gateway and the official openai client. The hung try is counted
against its replica, its connection is closed (the replica aborts the request), and no
counter is left behind."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import admin_client, gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
ADMIN = "first-byte-admin-0123456789"
SimFactory = Callable[..., tuple[Proc, str]]


def set_faults(sim: str, **faults: object) -> None:
    httpx.post(f"{sim}/sim/faults", json=faults).raise_for_status()


def sim_stats(sim: str) -> dict[str, float]:
    data: dict[str, float] = httpx.get(f"{sim}/sim/stats").json()
    return data


def test_a_hung_replica_is_retried_elsewhere_before_the_first_byte(
    sim_factory: SimFactory,
) -> None:
    # the hung replica's engine still decodes its 400 tokens (ignore_eos; 10 times slower
    # than real time) when its try is cut, so that cut is seen as an abort there
    (_, hung), (_, good) = sim_factory("--time-scale", "0.1"), sim_factory("--time-scale", "50")
    set_faults(hung, hang_after_tokens=0)  # takes the stream, never sends an event
    # a cut after 2 s: the good replica's first byte (milliseconds at time-scale 50) comes
    # well within it even on a loaded machine, so only the hung one is ever cut
    gw, base = gateway_proc(upstreams=[hung, good], args=["--policy", "round_robin"], env={
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "2", "KVGATE_ADMIN_TOKEN": ADMIN,
        "KVGATE_HEALTH__INTERVAL_S": "60", "KVGATE_HEALTH__EJECT_BASE_S": "60",
        "KVGATE_HEALTH__EJECT_MAX_S": "60", "KVGATE_HEALTH__FAILURE_THRESHOLD": "2",
        "KVGATE_FLOW__ENABLED": "true"})
    with gw:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        routes = []
        for i in range(4):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"story {i}"}],
                max_tokens=400, stream=True, extra_body={"ignore_eos": True})
            text = "".join(chunk.choices[0].delta.content or ""
                           for chunk in raw.parse() if chunk.choices)
            assert text, "answered by the other replica"
            assert raw.headers["x-kvgate-replica"].endswith(good[len("http://"):])
            routes.append(raw.headers["x-kvgate-route"])
        assert "retry" in routes  # at least the first pick was the hung one
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert any('reason="first_byte"' in k for k in retries), retries
        hung_key = f'{{pool="default",replica="{hung[len("http://"):]}"}}'
        assert metric_values(base, "kvgate_replica_failures_total")[hung_key] >= 2
        # two first-byte timeouts in a row (failure_threshold 2) took it out of rotation
        assert metric_values(base, "kvgate_replica_healthy")[hung_key] == 0.0
        # the hung tries' connections were closed: the replica aborted what it still ran
        wait_for(lambda: sim_stats(hung)["in_flight"] == 0, what="the hung replica aborts")
        seen = sim_stats(hung)
        assert seen["received"] >= 2 and seen["aborted"] >= 1, seen
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
        with admin_client(base, ADMIN) as admin:
            pool = admin.get("/replicas").json()["data"][0]
        for r in pool["replicas"]:
            assert (r["inflight"], r["inflight_prefill"]) == (0, 0), r
        # flow control: nothing queued, nothing held as if the hung tries were still running
        assert pool["flow"]["queued"] == 0 and pool["flow"]["saturated"] is False, pool


def test_every_replica_hung_is_a_504_after_max_attempts(sim_factory: SimFactory) -> None:
    sims = [sim_factory("--time-scale", "1")[1] for _ in range(3)]
    for sim in sims:
        set_faults(sim, hang_after_tokens=0)
    gw, base = gateway_proc(upstreams=sims, env={
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "0.4", "KVGATE_UPSTREAM__MAX_ATTEMPTS": "2",
        "KVGATE_HEALTH__INTERVAL_S": "60"})
    with gw:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "stream": True}
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["type"] == "GatewayTimeoutError"
        attempts = metric_values(base, "kvgate_replica_attempts_total")
        assert sum(attempts.values()) == 2  # max_attempts, not every replica
        assert sum(metric_values(base, "kvgate_replica_failures_total").values()) == 2
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
        wait_for(lambda: all(sim_stats(s)["in_flight"] == 0 for s in sims),
                 what="the replicas abort")
        # the total timeout stays the bound of the whole request: no new try past it
    gw, base = gateway_proc(upstreams=sims, env={
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "0.4",
        "KVGATE_UPSTREAM__TOTAL_TIMEOUT_S": "0.6", "KVGATE_HEALTH__INTERVAL_S": "60"})
    with gw:
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert resp.status_code == 504, resp.text
        assert "total timeout" in resp.json()["error"]["message"]
        assert sum(metric_values(base, "kvgate_replica_attempts_total").values()) == 2
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_a_busy_replica_streaming_for_others_is_not_ejected_by_first_byte_cuts(
    sim_factory: SimFactory,
) -> None:
    """A long queue delays the first byte too: requests that wait behind a stream the replica
    is busy generating are cut (504), but the replica is alive, so it stays in rotation."""
    _, sim = sim_factory("--time-scale", "1", "--max-num-seqs", "1")
    gw, base = gateway_proc(upstreams=[sim], env={
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "0.4", "KVGATE_HEALTH__INTERVAL_S": "60",
        "KVGATE_HEALTH__EJECT_BASE_S": "60", "KVGATE_HEALTH__EJECT_MAX_S": "60",
        "KVGATE_HEALTH__FAILURE_THRESHOLD": "2"})
    with gw, httpx.Client(timeout=30) as client:
        long = {"model": MODEL, "prompt": "long", "max_tokens": 2000, "stream": True,
                "ignore_eos": True}  # ~12 s of tokens
        with client.stream("POST", f"{base}/v1/completions", json=long) as busy:
            assert busy.status_code == 200
            lines = busy.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # decoding now
            for i in range(3):  # queued behind it (one sequence at a time): no first byte
                body = {"model": MODEL, "prompt": f"q{i}", "max_tokens": 5, "stream": True}
                resp = client.post(f"{base}/v1/completions", json=body)
                assert resp.status_code == 504, resp.text
            assert next(line for line in lines if line.startswith("data:"))  # still going
            healthy = metric_values(base, "kvgate_replica_healthy")
            assert list(healthy.values()) == [1.0], healthy


def test_keep_alive_comments_of_a_hung_replica_do_not_stop_the_retry(
    sim_factory: SimFactory,
) -> None:
    """vLLM's `--sse-keep-alive-interval` comments are not tokens: a hung engine that keeps
    pinging is cut at the first-byte timeout like a silent one, and the other replica answers
    the stream the client already holds open (the SDKs skip comment lines)."""
    _, hung = sim_factory("--time-scale", "1", "--sse-keep-alive-interval", "0.05")
    _, good = sim_factory("--time-scale", "50")
    set_faults(hung, hang_after_tokens=0)
    # a cut after 2 s (not 0.5 s): a good replica slow to start on a loaded machine is not
    # cut too, so the retries counted are the hung replica's alone
    gw, base = gateway_proc(upstreams=[hung, good], args=["--policy", "round_robin"], env={
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "2", "KVGATE_HEALTH__INTERVAL_S": "60"})
    with gw:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        for i in range(2):  # round robin: one of them starts on the hung replica
            stream = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"ping {i}"}],
                max_tokens=20, stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
        for i in range(2):  # a Responses stream: its opening events are no answer either
            events = list(c.responses.create(model=MODEL, input=f"ping {i}",
                                             max_output_tokens=5, stream=True))
            types = [e.type for e in events]
            assert types.count("response.created") == 1 and types[-1] == "response.completed"
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert retries['{pool="default",reason="first_byte"}'] == 2, retries
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
        wait_for(lambda: sim_stats(hung)["in_flight"] == 0, what="the hung replica aborts")


def test_a_long_non_streamed_request_does_not_excuse_a_hung_replica(
    sim_factory: SimFactory,
) -> None:
    """A non-streamed request is counted as waiting until its whole answer: its prompt is no
    evidence of prefill work still to do. A hung engine holding one with a long prompt (60,000
    tokens: 7.5 s at the prior's 8,000 tokens/s, far above the 0.5 s cut) is still judged
    hung by a short stream's first-byte cut, and taken out."""
    _, sim = sim_factory("--time-scale", "1", "--max-model-len", "131072")
    set_faults(sim, hang_after_tokens=0)  # every request taken, none ever answered
    gw, base = gateway_proc(upstreams=[sim], env={
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "0.5", "KVGATE_HEALTH__INTERVAL_S": "60",
        "KVGATE_HEALTH__EJECT_BASE_S": "60", "KVGATE_HEALTH__EJECT_MAX_S": "60",
        "KVGATE_HEALTH__FAILURE_THRESHOLD": "1", "KVGATE_ADMIN_TOKEN": ADMIN})
    with gw:
        long_prompt = "word " * 48_000  # 240,000 characters: 60,000 tokens

        def whole() -> None:  # in flight until the gateway stops (no answer ever comes)
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{base}/v1/completions", timeout=30, json={
                    "model": MODEL, "prompt": long_prompt, "max_tokens": 5})

        threading.Thread(target=whole, daemon=True).start()
        wait_for(lambda: inflight(base) == 1, what="the long request in flight")
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.APIStatusError) as caught:
            for _ in c.completions.create(model=MODEL, prompt="short", max_tokens=5,
                                          stream=True):
                pass
        assert caught.value.status_code == 504
        key = f'{{pool="default",replica="{sim[len("http://"):]}"}}'
        assert metric_values(base, "kvgate_replica_failures_total")[key] == 1
        assert metric_values(base, "kvgate_replica_healthy")[key] == 0.0
        gw.stop()  # ends the long request


def test_a_replica_decoding_non_streamed_answers_is_busy_not_hung(
    sim_factory: SimFactory,
) -> None:
    """Two long non-streamed answers fill the engine (`--max-num-seqs 2`); a stream queued
    behind them is cut at its first byte (a 504), but the replica is not failed: its scraped
    token counters move (it was ejected as hung: no first token, no answer, no prefill work
    in sight), and the next request is served."""
    _, sim = sim_factory("--time-scale", "1", "--max-num-seqs", "2")
    gw, base = gateway_proc(upstreams=[sim], env={
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "1", "KVGATE_HEALTH__INTERVAL_S": "60",
        "KVGATE_HEALTH__EJECT_BASE_S": "60", "KVGATE_HEALTH__EJECT_MAX_S": "60",
        "KVGATE_HEALTH__FAILURE_THRESHOLD": "1"})
    with gw:
        answers: list[int] = []

        def whole() -> None:  # about 19 s of decode at the sim's pace
            resp = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True})
            answers.append(resp.status_code)

        threads = [threading.Thread(target=whole) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: inflight(base) == 2, what="both whole requests in flight")
        wait_for(lambda: sim_stats(sim)["running"] == 2, what="the engine full")
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as caught:
            for _ in c.completions.create(model=MODEL, prompt="short", max_tokens=5,
                                          stream=True):
                pass
        assert caught.value.status_code == 504
        key = f'{{pool="default",replica="{sim[len("http://"):]}"}}'
        assert metric_values(base, "kvgate_replica_failures_total")[key] == 0
        assert metric_values(base, "kvgate_replica_healthy")[key] == 1.0
        for t in threads:
            t.join()
        assert answers == [200, 200]
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
