"""A hung engine (its sockets open, /health and /metrics 200, no token for any request): the
replica is found stalled from its scraped counters (`health.stall_after_s`), ejected, and a
non-streamed request waiting there is tried on another replica -- it used to wait for its
client's timeout (the SDK's 600 s) or `upstream.total_timeout_s` (30 min). Real simulators
(`engine_hang`), a real gateway, the official openai client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, inflight, metric_values, unread_chat, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
STALL_S = 2.0
SimFactory = Callable[..., tuple[Proc, str]]
ENV = {"KVGATE_HEALTH__STALL_AFTER_S": str(STALL_S)}


def set_faults(sim: str, **faults: object) -> None:
    httpx.post(f"{sim}/sim/faults", json=faults).raise_for_status()


def key(sim: str) -> str:
    return f'{{pool="default",replica="{sim.removeprefix("http://")}"}}'


def chat(client: openai.OpenAI, tokens: int = 8) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=tokens,
        extra_body={"ignore_eos": True})


def test_a_whole_answer_on_a_hung_engine_is_answered_by_another_replica(
    sim_factory: SimFactory,
) -> None:
    (_, hung), (_, good) = sim_factory(), sim_factory()
    gw, base = gateway_proc(upstreams=[hung, good], args=["--policy", "round_robin"], env=ENV)
    with gw:
        set_faults(hung, engine_hang=True)

        async def four() -> list[str]:
            c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=40)
            raws = await asyncio.gather(*(c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"q {i}"}], max_tokens=8)
                for i in range(4)))
            await c.close()
            assert all(r.parse().choices[0].message.content for r in raws)
            return [r.headers["x-kvgate-replica"] for r in raws]

        replicas = asyncio.run(four())  # round robin: some were sent to the hung one first
        assert all(r.endswith(good.removeprefix("http://")) for r in replicas), replicas
        assert metric_values(base, "kvgate_replica_stalls_total")[key(hung)] >= 1
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert any('reason="stall"' in k for k in retries), retries

        set_faults(hung, engine_hang=False)  # it steps again: back in rotation
        wait_for(lambda: metric_values(base, "kvgate_replica_healthy")[key(hung)] == 1,
                 timeout=20, what="the replica back")
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        served = {c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "again"}], max_tokens=4,
        ).headers["x-kvgate-replica"].split("/", 1)[1] for _ in range(6)}
        assert hung.removeprefix("http://") in served
        assert metric_values(base, "kvgate_replica_stalled")[key(hung)] == 0


@pytest.mark.parametrize("blind", [{"metrics_status": 500}, {"metrics_latency_ms": 3000}])
def test_an_unreadable_metrics_page_never_makes_a_stall(
    sim_factory: SimFactory, blind: dict[str, int],
) -> None:
    _, hung = sim_factory()
    # scrapes time out at 1 s (3 s late): the default bound became 5 s, at which a page 3 s
    # late is read, its frozen counters a stall -- not the blind exporter under test
    gw, base = gateway_proc(upstreams=[hung],
                            env={**ENV, "KVGATE_ROUTING__SCRAPE_TIMEOUT_MS": "1000"})
    with gw:
        set_faults(hung, engine_hang=True, **blind)
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        outcome: list[object] = []

        def ask() -> None:
            try:
                outcome.append(chat(c))
            except openai.APIError as exc:
                outcome.append(exc)

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(3 * STALL_S)  # scrapes fail (or time out): no evidence, no stall
        assert not outcome
        assert metric_values(base, "kvgate_replica_stalls_total")[key(hung)] == 0
        assert metric_values(base, "kvgate_replica_healthy")[key(hung)] == 1
        set_faults(hung, metrics_status=0, metrics_latency_ms=0)  # readable: frozen counters
        asker.join(40)
        assert outcome, "still waiting once the counters could be read"
        exc = outcome[0]
        assert isinstance(exc, openai.APIStatusError) and exc.status_code == 504, exc
        assert "stopped making progress" in exc.message
        assert metric_values(base, "kvgate_replica_stalls_total")[key(hung)] == 1


def test_a_long_generation_on_a_slow_replica_is_not_cut(sim_factory: SimFactory) -> None:
    _, slow = sim_factory("--time-scale", "0.05")  # a token every ~0.1 s: slow, moving
    gw, base = gateway_proc(upstreams=[slow], env=ENV)
    with gw:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        start = time.monotonic()
        answer = chat(c, tokens=60)
        assert time.monotonic() - start > 2 * STALL_S, "the setup: longer than the stall delay"
        assert answer.usage is not None and answer.usage.completion_tokens == 60
        assert metric_values(base, "kvgate_replica_stalls_total")[key(slow)] == 0


def test_a_request_held_from_before_an_ejection_neither_holds_back_nor_decides_the_trial(
    sim_factory: SimFactory,
) -> None:
    (_, flaky), (_, good) = sim_factory("--time-scale", "0.2"), sim_factory()
    gw, base = gateway_proc(upstreams=[flaky, good], args=["--policy", "round_robin"], env={
        "KVGATE_HEALTH__EJECT_BASE_S": "1", "KVGATE_HEALTH__EJECT_MAX_S": "30",
        "KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "3"})
    flaky_id = flaky.removeprefix("http://")
    with gw:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        held = None  # a long stream on the flaky replica (~30 tokens a second)
        for _ in range(6):
            stream = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "a long story"}],
                max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
            if stream.headers["x-kvgate-replica"].endswith(flaky_id):
                held = iter(stream.parse())
                next(held)  # its first event: the stream is under way
                break
            stream.http_response.close()
        assert held is not None, "no stream reached the flaky replica"
        set_faults(flaky, error_rate=1.0, error_status=503)  # new requests there fail
        wait_for(lambda: (chat(c), metric_values(base, "kvgate_replica_healthy")[key(flaky)])[1]
                 == 0, timeout=15, what="the flaky replica ejected")
        set_faults(flaky, error_rate=0.0)  # well again, the stream still going on there

        def trial_on_flaky() -> bool:
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            return raw.headers["x-kvgate-replica"].endswith(flaky_id)

        # its back-off over, the stream it holds (its tokens moving) does not hold its trial
        # back: it did until that stream ended
        wait_for(trial_on_flaky, timeout=30, what="a trial on the flaky replica")
        set_faults(flaky, hang_after_tokens=0)  # the held stream stops: its idle timeout
        with pytest.raises(openai.APIError):
            for _chunk in held:
                pass
        # sent before the ejection, its failure does not eject the replica again
        assert metric_values(base, "kvgate_replica_healthy")[key(flaky)] == 1
        set_faults(flaky, hang_after_tokens=-1)
        assert any(trial_on_flaky() for _ in range(4))


def test_every_worker_finds_the_stall_and_retries_its_own_requests(
    redis_url: str, sim_factory: SimFactory,
) -> None:
    (_, hung), (_, good) = sim_factory(), sim_factory()
    gw, base = gateway_proc(config={
        "pools": {"p": {"replicas": [hung, good], "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}},
        "routing": {"policy": "round_robin"},
        "server": {"workers": 2},
        "health": {"stall_after_s": STALL_S},
    }, env={"KVGATE_REDIS_URL": redis_url})
    with gw:
        set_faults(hung, engine_hang=True)

        async def eight() -> list[str]:
            async def one(i: int) -> str:  # a client (a connection) each: the kernel
                c = openai.AsyncOpenAI(  # spreads them over the workers
                    base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=40)
                raw = await c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"q {i}"}],
                    max_tokens=8)
                await c.close()
                return raw.headers["x-kvgate-replica"]

            return list(await asyncio.gather(*(one(i) for i in range(8))))

        replicas = asyncio.run(eight())
        assert all(r.endswith(good.removeprefix("http://")) for r in replicas), replicas

        def stalls() -> float:
            found = metric_values(base, "kvgate_replica_stalls_total")
            return sum(v for k, v in found.items() if hung.removeprefix("http://") in k)

        # /metrics answers with the other worker's series as it last wrote them (up to ~1 s
        # old): the stall a worker found shows within a moment, not at once
        wait_for(lambda: stalls() >= 1, timeout=20, what="the stall counted")


def test_a_client_reading_slowly_does_not_make_an_idle_engine_stalled(
    sim_factory: SimFactory,
) -> None:
    """A stream the engine finished whose client has not read it all: the engine is idle
    (nothing running or waiting, its counters still), the request is in flight in kvgate
    only. Counted as work there, it made the replica stalled after `stall_after_s` and a
    one-replica pool answered every other client 503 until that client was done (or cut at
    the idle timeout, 2 minutes). Only requests still waiting for their answer to start say
    the engine owes tokens."""
    _, sim = sim_factory("--time-scale", "100", "--max-model-len", "200000")
    gw, base = gateway_proc(upstreams=[sim], env=ENV)
    with gw:
        port = int(base.rsplit(":", 1)[1])
        s = unread_chat(port, {"model": MODEL, "stream": True, "max_tokens": 100000,
                               "messages": [{"role": "user", "content": "a long one"}],
                               "ignore_eos": True})
        try:
            wait_for(lambda: httpx.get(f"{sim}/sim/stats").json()["running"] == 0
                     and inflight(base) == 1, 90, "the engine to finish, the client not")
            time.sleep(3 * STALL_S)  # (scrapes every 250 ms: the judge has had its look)
            assert inflight(base) == 1  # (still unread)
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
            assert chat(client).choices[0].message.content
            assert metric_values(base, "kvgate_replica_stalls_total")[key(sim)] == 0
        finally:
            s.close()
