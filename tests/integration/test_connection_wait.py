"""A request waiting for one of a replica's connections (`upstream.max_connections`) waits in
kvgate's own queue: with real simulators, a real gateway and the official openai client, a
replica at its connection limit is busy, not broken. The wait is bounded by
`upstream.connection_wait_s` (a 503 with Retry-After naming the limit, the replica not
charged, never ejected), and the first-byte clock starts when the request is sent, so a
request that got its slot late is not cut for the time it waited in kvgate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "hold the only connection"}]


def _gateway(sim: str, wait_s: float) -> tuple[Proc, str]:
    return gateway_proc(upstreams=[sim], env={
        "KVGATE_UPSTREAM__MAX_CONNECTIONS": "1", "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "1",
        "KVGATE_UPSTREAM__CONNECTION_WAIT_S": str(wait_s),
        "KVGATE_HEALTH__FAILURE_THRESHOLD": "2", "KVGATE_HEALTH__INTERVAL_S": "60"})


def _hold_the_slot(sim: str, base: str, delay_ms: int) -> threading.Thread:
    """A whole (non-streamed) request that holds the replica's only connection for about
    `delay_ms` (the simulator's latency fault, read when the request arrives; reset after)."""
    httpx.post(f"{sim}/sim/faults", json={"latency_ms": delay_ms}).raise_for_status()
    before = _chats_received(sim)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    held = threading.Thread(target=lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4))
    held.start()
    # it reached the simulator, which took its latency then (a fixed sleep was not always
    # enough on a loaded machine: the latency was reset first and the slot came free at once)
    wait_for(lambda: _chats_received(sim) > before, what="the slot holder at the simulator")
    httpx.post(f"{sim}/sim/faults", json={"latency_ms": 0}).raise_for_status()
    assert inflight(base) == 1
    return held


def _chats_received(sim: str) -> int:
    """Chat requests the simulator has read (its request log: it reads the latency fault right
    after logging one)."""
    logged = httpx.get(f"{sim}/sim/requests").json()["requests"]
    return sum(r["path"] == "/v1/chat/completions" for r in logged)


def _stream(base: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    chunks = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _failures(base: str) -> float:
    return sum(metric_values(base, "kvgate_replica_failures_total").values())


def _healthy(base: str) -> float:
    return sum(metric_values(base, "kvgate_replica_healthy").values())


def test_a_replica_at_its_connection_limit_is_busy_not_failing(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = _gateway(sim, 1.0)
    with gw:
        held = _hold_the_slot(sim, base, 6000)
        answers = []
        for _ in range(3):  # past health.failure_threshold, were each charged
            t0 = time.monotonic()
            try:
                _stream(base)
            except openai.APIStatusError as exc:
                answers.append((exc.status_code, exc.message, exc.response.headers.get(
                    "retry-after"), time.monotonic() - t0))
        held.join()
        assert [a[0] for a in answers] == [503, 503, 503], answers
        for _, message, retry_after, waited in answers:
            assert "upstream.max_connections" in message, message
            assert retry_after == "1"
            assert 0.9 < waited < 3.0
        assert _failures(base) == 0
        assert _healthy(base) == 1
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert not any("connection_wait" in labels for labels in retries)  # one replica only
        assert _stream(base)  # the replica serves the next request at once


def test_the_first_byte_clock_starts_when_the_request_is_sent(sim_factory: SimFactory) -> None:
    """The request waits ~1.7 s for the connection (longer than the 1 s first-byte timeout),
    then the replica answers at once: served, not cut for kvgate's own queue."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = _gateway(sim, 10.0)
    with gw:
        held = _hold_the_slot(sim, base, 2000)
        t0 = time.monotonic()
        assert _stream(base)
        assert time.monotonic() - t0 > 1.0  # it did wait for the slot
        held.join()
        assert _failures(base) == 0


def test_a_request_waiting_too_long_goes_to_another_replica(sim_factory: SimFactory) -> None:
    """Round robin picks the replica whose only connection is held: past the wait, the next
    replica answers it (retried for `connection_wait`), and neither replica is charged."""
    (_, busy), (_, other) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[busy, other], args=["--policy", "round_robin"], env={
        "KVGATE_UPSTREAM__MAX_CONNECTIONS": "1", "KVGATE_UPSTREAM__CONNECTION_WAIT_S": "0.5",
        "KVGATE_HEALTH__INTERVAL_S": "60",
        # nothing is heard from the held replica for 3 s: past `routing.silent_min_s` (0.5 s)
        # it is no candidate, and on a loaded machine round robin went to the other one at once
        "KVGATE_ROUTING__SILENT_MIN_S": "0"})
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        placed: list[str] = []
        for _ in range(4):  # which replica round robin starts with: learnt from the answers
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=2)
            placed.append(raw.headers["x-kvgate-replica"])
        assert placed[0] == placed[2] != placed[1] == placed[3]
        first = busy if placed[0].endswith(busy.removeprefix("http://")) else other
        held = _hold_the_slot(first, base, 3000)  # the next pick: `first`
        _stream(base)  # round robin's next: the other one, at once
        t0 = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=2)  # `first` again: waits, moves on
        assert 0.4 < time.monotonic() - t0 < 2.5
        assert not raw.headers["x-kvgate-replica"].endswith(first.removeprefix("http://"))
        held.join()
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert sum(v for k, v in retries.items() if 'reason="connection_wait"' in k) == 1
        assert _failures(base) == 0
        assert _healthy(base) == 2
