"""vLLM 0.34's failure modes through a real kvgate (issue 15: 2-4, 10; issue 10: faults 1, 3, 7,
10): a dead engine's 500, refused connections, EngineFaultedError's 503, the busy 503, the
mid-stream error event, non-OpenAI error bodies, the retry budget, the idle timeout."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import openai
import orjson
import pytest
from openai._legacy_response import LegacyAPIResponse
from openai.types import Completion

from gateway.errors import ReplicaRefused
from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
# an ejection lasts the whole test (else it turns half-open after the fast tests' 0.2 s)
STICKY = {"KVGATE_HEALTH__EJECT_BASE_S": "60", "KVGATE_HEALTH__EJECT_MAX_S": "60"}
QUIET_HEALTH = {**STICKY, "KVGATE_HEALTH__INTERVAL_S": "600"}  # only requests notice


def set_faults(sim: str, **faults: object) -> None:
    httpx.post(f"{sim}/sim/faults", json=faults).raise_for_status()


def client(base: str, timeout: float = 30.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=timeout)


def replica_of(raw: LegacyAPIResponse[Completion]) -> str:
    return "http://" + raw.headers["x-kvgate-replica"].partition("/")[2]


def healthy(base: str, sim: str) -> float:
    return metric_values(base, "kvgate_replica_healthy")[f'{{pool="default",replica="{sim[7:]}"}}']


def retries(base: str) -> dict[str, float]:
    return metric_values(base, "kvgate_upstream_retries_total")


def sse_events(resp: httpx.Response) -> list[str]:
    return [line for line in resp.iter_lines() if line.startswith("data:")]


@contextmanager
def occupied(sim: str) -> Iterator[None]:
    """Hold one long stream on `sim` directly (the gateway does not see it), so a replica with
    --max-num-queued-reqs 1 answers vLLM's busy 503 to everything else."""
    started, stop = threading.Event(), threading.Event()

    def hold() -> None:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 20000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{sim}/v1/completions", json=body, timeout=60) as resp:
            for _ in resp.iter_lines():
                started.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert started.wait(20)
    try:
        yield
    finally:
        stop.set()
        thread.join(20)


def test_dead_engine_500_is_retried_elsewhere_and_marks_the_replica_down(
    sim_factory: SimFactory,
) -> None:
    (_, a), (_, b) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[a, b], args=["--policy", "round_robin"], env=QUIET_HEALTH)
    with gw:
        set_faults(a, dead=True)  # 500 InternalServerError "The server had an error ..."
        c = client(base)
        for _ in range(4):
            raw = c.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
            assert raw.parse().choices[0].text and replica_of(raw) == b
        assert any("status_500" in k for k in retries(base))
        assert healthy(base, a) == 0.0  # down after one such answer, /health not asked
        assert sum(retries(base).values()) == 1  # and no request was sent there again


def test_connection_refused_marks_down_at_once(sim_factory: SimFactory) -> None:
    (a_proc, a), (_, b) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[a, b], args=["--policy", "round_robin"], env=QUIET_HEALTH)
    with gw:
        a_proc.kill()
        c = client(base)
        # round robin: the first or the second request tries `a`, unless the gateway's first
        # health probe (at its start, racing this kill on a loaded machine) found it down
        # first: then no request goes there and nothing is retried
        for _ in range(20):
            if retries(base) or healthy(base, a) == 0.0:
                break
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert healthy(base, a) == 0.0  # one refused connection, not failure_threshold (2)


def test_engine_faulted_503_ejects_the_replica(sim_factory: SimFactory) -> None:
    (_, a), (_, b) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    # /health keeps answering 200 for a faulted engine: only the requests can tell
    gw, base = gateway_proc(upstreams=[a, b], args=["--policy", "round_robin"], env=STICKY)
    with gw:
        set_faults(a, engine_faulted=True)
        c = client(base)
        for _ in range(6):
            raw = c.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
            assert replica_of(raw) == b
        assert healthy(base, a) == 0.0
        assert sum(retries(base).values()) == 2  # failure_threshold, then no more tries


def test_a_replica_serving_another_model_is_taken_out_and_its_requests_go_elsewhere(
    sim_factory: SimFactory,
) -> None:
    """A replica restarted with another model answers every request at once with vLLM's 404
    "The model `...` does not exist." for the pool's served name -- a black hole that looks
    unloaded, healthy (its /health says 200) and, once a conversation was routed there, holds
    its prefix: every later turn went there and failed. The model is the pool's, not the
    client's choice: the replica is taken out, the request is answered by another one, and
    with none left the client gets a 503 naming what the replica serves, not a 404 blaming its
    model. (Requests found it before its health check read its /v1/models: now the check
    takes it out first, and no request tries it.)"""
    (_, good), (_, wrong) = sim_factory("--time-scale", "50"), sim_factory(
        "--time-scale", "50", model="another-model")
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [good, wrong]}},
              "models": {"public": {"default": "p"}}}
    gw, base = gateway_proc(config=config, env=STICKY)
    with gw:
        c = client(base)
        system = "the rules of this conversation " * 60
        for turn in range(6):  # a conversation, then others: none fails, none lands there
            raw = c.chat.completions.with_raw_response.create(
                model="public", max_tokens=2, messages=[
                    {"role": "system", "content": f"{turn // 3} {system}"},
                    {"role": "user", "content": f"turn {turn}"}])
            assert raw.http_response.status_code == 200
            assert replica_of(raw) == good  # type: ignore[arg-type]
        assert metric_values(base, "kvgate_replica_healthy")[
            f'{{pool="p",replica="{wrong[7:]}"}}'] == 0.0

    gw, base = gateway_proc(config={**config, "pools": {"p": {
        "served_model": MODEL, "replicas": [wrong]}}}, env=STICKY, ready=False)
    with gw:
        # its health check reads what it serves (tests/integration/test_wrong_model_replica.py)
        wait_for(lambda: "serves model" in httpx.get(f"{base}/readyz", timeout=5).text,
                 what="the health check to name the wrong model")
        resp = httpx.post(f"{base}/v1/completions", json={
            "model": "public", "prompt": "x", "max_tokens": 2})
        assert resp.status_code == 503
        assert resp.json()["error"]["type"] == "ServiceUnavailableError"
        assert "serves model 'another-model'" in resp.json()["error"]["message"]
        assert inflight(base) == 0


def test_busy_503_backs_off_and_retries_go_elsewhere(sim_factory: SimFactory) -> None:
    (_, a), (_, b) = (sim_factory("--time-scale", "1", "--max-num-queued-reqs", "1"),
                      sim_factory("--time-scale", "50"))
    gw, base = gateway_proc(upstreams=[a, b], args=["--policy", "round_robin"], env={
        "KVGATE_HEALTH__BUSY_BACKOFF_S": "60", "KVGATE_HEALTH__BUSY_BACKOFF_MAX_S": "60"})
    with gw, occupied(a):
        c = client(base)
        for i in range(6):
            raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"p{i}",
                                                          max_tokens=2)
            assert replica_of(raw) == b
        # one busy answer, then `a` gets no new picks while it backs off; busy is not broken
        assert retries(base) == {'{pool="default",reason="busy"}': 1.0}
        assert healthy(base, a) == 1.0


def test_a_busy_last_replica_is_a_503_with_retry_after(sim_factory: SimFactory) -> None:
    _, a = sim_factory("--time-scale", "1", "--max-num-queued-reqs", "1")
    gw, base = gateway_proc(upstreams=[a])
    with gw, occupied(a):
        resp = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == 503


async def test_retry_budget_exhausted_is_503_with_retry_after(sim_factory: SimFactory) -> None:
    sims = [sim_factory("--time-scale", "1", "--max-num-queued-reqs", "1")[1] for _ in range(2)]
    gw, base = gateway_proc(upstreams=sims, env={
        "KVGATE_UPSTREAM__RETRY_BUDGET_MIN": "1", "KVGATE_UPSTREAM__RETRY_BUDGET_RATIO": "0"})
    with gw, occupied(sims[0]), occupied(sims[1]):
        async with httpx.AsyncClient(timeout=30) as http:
            answers = await asyncio.gather(*(http.post(
                f"{base}/v1/completions", json={"model": MODEL, "prompt": f"p{i}"})
                for i in range(8)))
            # the one reserve retry is spent and the ratio adds nothing: from now on no
            # request is retried, each gets its first replica's busy 503 (with Retry-After)
            spent = sum(retries(base).values())
            # ... counted once: the retry the reserve paid for (requests whose first try failed
            # after it was spent were counted as retried too, their clients answered 503)
            assert spent == 1, retries(base)
            for i in range(6):
                later = await http.post(f"{base}/v1/completions",
                                        json={"model": MODEL, "prompt": f"q{i}"})
                assert later.status_code == 503 and later.headers["retry-after"] == "1"
                answers.append(later)
            assert sum(retries(base).values()) == spent  # a disabled budget retries each
    assert [r.status_code for r in answers] == [503] * 14  # never a 502 "answered 503"
    assert all(r.headers.get("retry-after") == "1" for r in answers)
    assert all(r.json()["error"]["type"] for r in answers)


def test_mid_stream_engine_death_is_relayed_and_counted_as_a_failure(
    sim_factory: SimFactory,
) -> None:
    _, a = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[a], env=QUIET_HEALTH)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with gw:
        for _ in range(2):  # failure_threshold 2
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                assert '"choices"' in next(x for x in lines if x.startswith("data:"))
                set_faults(a, dead=True)
                events = [x for x in lines if x.startswith("data:")]
            set_faults(a, dead=False)
            # vLLM's own error event and [DONE] reach the client as sent
            assert events[-1] == "data: [DONE]"
            assert orjson.loads(events[-2][5:])["error"]["code"] == 500
        statuses = metric_values(base, "kvgate_requests_total")
        assert sum(v for k, v in statuses.items() if 'status="500"' in k) == 2
        assert healthy(base, a) == 0.0  # two failures in a row: ejected


def test_stall_after_first_tokens_is_cut_by_the_idle_timeout_as_504(
    sim_factory: SimFactory,
) -> None:
    _, a = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[a], env={
        **QUIET_HEALTH, "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "120",
        "KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "1"})
    with gw:
        set_faults(a, hang_after_tokens=5)
        body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
        for _ in range(2):  # failure_threshold 2
            # cut after ~1 s of silence, long before the 120 s first-byte timeout (the
            # client's 30 s read timeout would fire first otherwise)
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
                events = sse_events(r)
            err = orjson.loads(events[-2][5:])["error"]
            assert events[-1] == "data: [DONE]"
            assert (err["code"], err["type"]) == (504, "GatewayTimeoutError")
            assert "idle" in err["message"]
            assert any('"text"' in e for e in events[:-2])  # the answer had started
        assert healthy(base, a) == 0.0  # stalled streams are failures of the replica
        statuses = metric_values(base, "kvgate_requests_total")
        assert sum(v for k, v in statuses.items() if 'status="504"' in k) == 2
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


@pytest.mark.parametrize(
    ("sim_args", "status", "type_", "message"),
    [
        # vLLM's --api-key middleware answers a bare {"error": "Unauthorized"}: about the
        # gateway's credentials, not the client's (tests/integration/test_upstream_settings.py)
        (("--api-key", "upstream-secret"), 502, "BadGatewayError",
         ReplicaRefused(401).message),
        # vLLM < 0.10.1: the flat {"object": "error", ...} shape (a request it refuses: n=0)
        (("--legacy-errors",), 400, "BadRequestError", "n must be at least 1, got 0."),
    ],
)
def test_upstream_errors_are_openai_shaped(
    sim_factory: SimFactory, sim_args: tuple[str, ...], status: int, type_: str, message: str,
) -> None:
    _, a = sim_factory(*sim_args)
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [a]}}}
    gw, base = gateway_proc(config=config)
    with gw:
        resp = httpx.post(f"{base}/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 2, "n": 0})
    assert resp.status_code == status
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]  # OpenAI's (and vLLM >= 0.10.1's) nested shape
    assert (err["message"], err["type"], err["code"]) == (message, type_, status)
