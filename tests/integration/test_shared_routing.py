"""Several gateways decide as one: real redis-server, real gateways and simulators, the
official openai client. Conversations alternate between gateways and still land on their
replica; one gateway's long streams count in the other's bounded-load view; Redis stopped
under load loses nothing, both report degraded, and sharing resumes when it returns."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import KVGATE, Proc, free_port, redis_proc

pytestmark = pytest.mark.slow

ADMIN = "shared-routing-admin-token-0123"
MODEL = "sim-model"


def _gateways(
    redis_url: str, upstreams: list[str], n: int = 2, extra: dict[str, object] | None = None
) -> tuple[ExitStack, list[str]]:
    stack = ExitStack()
    bases = []
    config = {
        "pools": {"p": {"replicas": upstreams, "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}},
        "routing": {"policy": "cache_aware", "scrape_interval_ms": 100},
        **(extra or {}),
    }
    for _ in range(n):
        proc, base = gateway_proc(config=config, env={
            "KVGATE_REDIS_URL": redis_url, "KVGATE_ADMIN_TOKEN": ADMIN})
        stack.enter_context(proc)
        bases.append(base)
    return stack, bases


@pytest.fixture
def fleet(sim_factory: Callable[..., tuple[Proc, str]]) -> list[str]:
    return [sim_factory()[1] for _ in range(4)]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def _turn(client: openai.OpenAI, messages: list[ChatCompletionMessageParam]) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=8)
    reply = raw.parse().choices[0].message.content or ""
    messages.append({"role": "assistant", "content": reply})
    return raw.headers["x-kvgate-replica"]


def _conversation_replicas(bases: list[str], conversations: int, turns: int) -> list[list[str]]:
    clients = [_client(b) for b in bases]
    out = []
    for c in range(conversations):
        system = f"conversation {c}: " + " ".join(f"rule-{c}-{i}" for i in range(160))
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}]
        seen = []
        for t in range(turns):
            messages.append({"role": "user", "content": f"turn {t} of conversation {c}, go on"})
            seen.append(_turn(clients[t % len(clients)], messages))
        out.append(seen)
    return out


def test_conversations_alternating_between_gateways_keep_their_replica(
    redis_url: str, fleet: list[str]
) -> None:
    stack, bases = _gateways(redis_url, fleet)
    with stack:
        wait_for(lambda: all(_peers(b) == 1 for b in bases), what="gateways see each other")
        for seen in _conversation_replicas(bases, conversations=5, turns=6):
            assert len(set(seen)) == 1, seen  # every turn on the first turn's replica
        for base in bases:
            applied = metric_values(base, "kvgate_sync_records_applied_total")[""]
            assert applied > 0
            assert metric_values(base, "kvgate_routing_peer_decisions_total")[""] > 0


def test_without_sharing_conversations_scatter(redis_url: str, fleet: list[str]) -> None:
    """The baseline the feature fixes (and proof the test above can fail)."""
    stack, bases = _gateways(redis_url, fleet, extra={"sync": {"enabled": False}})
    with stack:
        scattered = [s for s in _conversation_replicas(bases, 5, 6) if len(set(s)) > 1]
        assert scattered


def _peers(base: str) -> int:
    doc = httpx.get(f"{base}/readyz", timeout=5).json()
    return int(doc.get("sync", {}).get("peers", 0))


def _admin(base: str, path: str, body: dict[str, object] | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    if body is None:
        return httpx.get(f"{base}/admin{path}", headers=headers, timeout=5)
    return httpx.post(f"{base}/admin{path}", headers=headers, json=body, timeout=5)


def _fleet_inflight(base: str) -> tuple[int, int]:
    """(own, fleet-wide) in-flight requests over every replica in `base`'s admin view."""
    doc = _admin(base, "/replicas").json()
    reps = [r for p in doc["data"] for r in p["replicas"]]
    return sum(r["inflight"] for r in reps), sum(r["inflight_fleet"] for r in reps)


@pytest.fixture
def streams() -> Iterator[Callable[[str, int, str], None]]:
    """Open long streams (they hold their replica until the test ends)."""
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def open_streams(base: str, n: int, prompt: str) -> None:
        def run(i: int) -> None:
            url = f"{base}/v1/chat/completions"
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url, timeout=60, json={
                "model": MODEL, "stream": True, "max_tokens": 5_000, "ignore_eos": True,
                "messages": [{"role": "user", "content": prompt + f" stream {i}"}],
            }) as resp:
                for _ in resp.iter_bytes():
                    if stop.is_set():
                        return

        for i in range(n):
            t = threading.Thread(target=run, args=(i,), daemon=True)
            t.start()
            threads.append(t)

    yield open_streams
    stop.set()
    for t in threads:
        t.join(timeout=10)


def test_streams_through_one_gateway_count_in_the_others_load_bound(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
    streams: Callable[[str, int, str], None],
) -> None:
    sims = [sim_factory("--time-scale", "1")[1] for _ in range(2)]
    # a bound that binds at a few requests (the default's slack admits more at low load)
    tight: dict[str, object] = {"routing": {"policy": "cache_aware", "scrape_interval_ms": 100,
                         "load_factor": 1.25, "load_slack": 1.0}}
    stack, (a, b) = _gateways(redis_url, sims, extra=tight)
    with stack:
        prompt = "shared long prefix " * 80
        streams(a, 4, prompt)
        wait_for(lambda: _fleet_inflight(a)[0] == 4, what="A's streams in flight")
        wait_for(lambda: _fleet_inflight(b) == (0, 4), timeout=5,
                 what="B sees A's streams as fleet-wide in-flight, none of its own")
        explained = _admin(b, "/route/explain", {"tier": "default", "request": {
            "model": MODEL, "messages": [{"role": "user", "content": prompt + " stream 9"}]}})
        assert explained.status_code == 200, explained.text
        ranked = explained.json()["candidates"]
        assert sum(c["terms"]["inflight"] for c in ranked) == 4
        # the bounded-load rule: 4 in flight over 2 replicas, limit 1.25 x 5/2 + 1 - 1
        loaded = [c for c in ranked if c["terms"]["inflight"] > 3.125]
        assert all(c["terms"]["admitted"] == 0.0 for c in loaded)


def test_redis_stopped_under_load_then_back(
    sim_factory: Callable[..., tuple[Proc, str]], fleet: list[str]
) -> None:
    port = free_port()
    proc, url = redis_proc(port)
    proc.start()
    try:
        stack, bases = _gateways(url, fleet)
        with stack:
            wait_for(lambda: all(_peers(x) == 1 for x in bases), what="peers")
            errors: list[BaseException] = []
            done = threading.Event()

            def load(base: str) -> None:
                client = _client(base)
                i = 0
                while not done.is_set():
                    try:
                        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                            {"role": "user", "content": f"load {base} {i}"}])
                    except Exception as exc:  # counted: nothing may be lost
                        errors.append(exc)
                    i += 1

            workers = [threading.Thread(target=load, args=(x,)) for x in bases for _ in range(2)]
            for w in workers:
                w.start()
            try:
                proc.stop()
                wait_for(lambda: all(_degraded(x) for x in bases), what="degraded reported")
                assert all(metric_values(x, "kvgate_sync_up")[""] == 0.0 for x in bases)
                proc, _ = redis_proc(port)
                proc.start()
                wait_for(lambda: not any(_degraded(x) for x in bases), timeout=20,
                         what="degraded cleared")
            finally:
                done.set()
                for w in workers:
                    w.join(timeout=30)
            assert errors == []
            # sharing resumed: a new conversation alternating gateways keeps its replica
            wait_for(lambda: all(_peers(x) == 1 for x in bases), what="peers again")
            for seen in _conversation_replicas(bases, conversations=2, turns=4):
                assert len(set(seen)) == 1, seen
    finally:
        proc.stop()


def _degraded(base: str) -> bool:
    doc = httpx.get(f"{base}/readyz", timeout=5).json()
    return bool(doc["sync"]["degraded"])


def test_a_redis_that_never_answered_is_named_once_and_joined_when_it_comes_up(
    fleet: list[str],
) -> None:
    """A wrong or not-yet-started Redis: the start line says where the sharing connects, one
    line names the address and the OS error (not the password), no "on" line while it does not
    answer; when Redis comes up, one line says so and `degraded` clears."""
    port = free_port()
    url = f"redis://:sync-secret-pw@127.0.0.1:{port}/0"
    config = {"pools": {"p": {"replicas": fleet[:1], "served_model": MODEL}},
              "models": {MODEL: {"default": "p"}}}
    gw, base = gateway_proc(config=config, ready=False, args=["--log-level", "info"],
                            env={"KVGATE_REDIS_URL": url, "KVGATE_ADMIN_TOKEN": ADMIN})
    redis, _ = redis_proc(port)
    redis = Proc([*redis.cmd, "--requirepass", "sync-secret-pw"], ready_port=port)

    def sync_lines() -> list[str]:
        return [line for line in gw.output().splitlines() if "shared routing state" in line]

    with gw:
        try:
            cannot = f"shared routing state: cannot reach Redis at 127.0.0.1:{port} "
            wait_for(lambda: any(cannot in line for line in sync_lines()), what="a first line")
            time.sleep(3)  # both loops retried every 0.5 s meanwhile
            lines = sync_lines()
            assert len(lines) == 2, lines
            assert f"shared routing state: connecting to Redis at 127.0.0.1:{port}" in lines[0]
            assert f"{cannot}(connection refused); retrying every 0.5 s" in lines[1]
            assert _degraded(base)
            redis.start()
            wait_for(lambda: not _degraded(base), timeout=20, what="degraded cleared")
            back = f"shared routing state: Redis at 127.0.0.1:{port} answers again"
            wait_for(lambda: any(back in line for line in sync_lines()), what="recovery line")
            assert not any("shared routing state on" in line for line in sync_lines())
            assert "sync-secret-pw" not in gw.output()
        finally:
            redis.stop()


def test_workers_of_one_gateway_decide_as_one(redis_url: str, fleet: list[str]) -> None:
    """`server.workers 2`: one port, two processes; conversations keep their replica whichever
    worker takes each turn (a new connection per request, so the kernel spreads them)."""
    stack, (base,) = _gateways(redis_url, fleet, n=1, extra={"server": {"workers": 2}})
    with stack:
        members: set[str] = set()

        def both_workers_up() -> bool:
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
                doc = c.get(f"{base}/readyz", timeout=5).json()
            members.add(doc["sync"]["member"])
            return len(members) == 2 and doc["sync"]["peers"] == 1

        wait_for(both_workers_up, what="two workers that see each other")
        fresh = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        # the SDK annotates http_client as httpx2.Client but also takes an httpx.Client
        # (openai/_httpx2.py, is_legacy_httpx_sync_client)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=30, http_client=fresh)  # type: ignore[arg-type]
        for c in range(4):
            system = f"worker conversation {c}: " + " ".join(f"w-{c}-{i}" for i in range(160))
            messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": system}]
            seen = []
            for t in range(6):
                messages.append({"role": "user", "content": f"turn {t}, go on"})
                seen.append(_turn(client, messages))
                # a client reads its answer before the next turn: 50 ms, so that two worker
                # processes starved of CPU by a loaded machine still exchange the record (the
                # two-gateway test above sends turns back to back)
                time.sleep(0.05)
            assert len(set(seen)) == 1, seen
        fresh.close()


def test_workers_without_redis_are_refused(fleet: list[str]) -> None:
    cmd = [*KVGATE, "serve", "--no-auth", "--host", "127.0.0.1", "--port", str(free_port()),
           "--workers", "2", "--upstream", fleet[0]]
    env = {**os.environ, "KVGATE_REDIS_URL": "", "KVGATE_CONFIG": ""}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "server.workers > 1 needs KVGATE_REDIS_URL" in done.stderr
    assert "Traceback" not in done.stderr
