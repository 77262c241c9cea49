"""`server.workers 2` with Redis down: a worker that dies and is started again while Redis is
away starts from the state its siblings last loaded (the supervisor's snapshot), so it serves
the tenants' keys like the others, and /readyz says the same whichever worker answers it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc

pytestmark = pytest.mark.slow

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "workers-restart-admin-token-0123"
BODY = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _children(proc: Proc) -> list[int]:
    assert proc.popen is not None
    out = subprocess.run(["pgrep", "-P", str(proc.popen.pid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def _by_worker(base: str, n: int, ask: Callable[[httpx.Client], httpx.Response],
               ) -> dict[str, httpx.Response]:
    """One answer of each of the ``n`` workers (told apart by their shared-state member id,
    read from /readyz on the same connection), a new connection per try."""
    seen: dict[str, httpx.Response] = {}

    def each() -> bool:
        with httpx.Client(timeout=10) as c:  # one connection: one worker answers both
            member = c.get(f"{base}/readyz").json()["sync"]["member"]
            if member not in seen:
                seen[member] = ask(c)
        return len(seen) == n

    wait_for(each, timeout=20, what=f"answers from {n} workers")
    return seen


def _config(sim: str) -> dict[str, object]:
    """One pool of `sim`, tenant acme on the free tier."""
    return {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"rpm": 10_000}}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }


def test_a_worker_restarted_while_redis_is_down_serves_the_last_state(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    config = _config(sim)
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url}
    gw, base = gateway_proc(config=config, env=env, auth=True, args=["--workers", "2"])
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        auth = {"Authorization": f"Bearer {key}"}

        def chat(c: httpx.Client) -> httpx.Response:
            return c.post(f"{base}/v1/chat/completions", json=BODY, headers=auth)

        # both workers know the key before Redis goes
        assert {r.status_code for r in _by_worker(base, 2, chat).values()} == {200}
        redis.stop()
        before = _children(gw)
        os.kill(before[0], signal.SIGKILL)
        wait_for(lambda: len(set(_children(gw)) - {before[0]}) == 2, timeout=20,
                 what="the killed worker started again")
        answers = _by_worker(base, 2, chat)
        assert {r.status_code for r in answers.values()} == {200}, [
            r.text for r in answers.values()]
        ready = _by_worker(base, 2, lambda c: c.get(f"{base}/readyz"))
        assert {r.status_code for r in ready.values()} == {200}, [r.text for r in ready.values()]
        docs = [r.json() for r in ready.values()]
        for doc in docs:  # degraded, and saying so, on both
            assert doc["degraded"] is True and doc["tenancy"]["degraded"] is True, doc
        assert len({doc["tenancy"]["policy_version"] for doc in docs}) == 1, docs
        assert "serving the state the other workers last loaded" in gw.output()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not reaped yet
    except FileNotFoundError:
        return True


def test_a_killed_supervisor_leaves_no_tenancy_state_behind(
    sim_factory: SimFactory, tmp_path: Path,
) -> None:
    """The supervisor removes its directory when it exits, but not when it is killed
    (SIGKILL): the workers' tenancy state (key hashes, tenants, the policy with its replicas'
    URLs, credentials included) stayed in TMPDIR for good. The workers, stopped by the
    kernel as their supervisor dies, remove it as they exit."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    config = _config(sim)
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url, "TMPDIR": str(tmp_path)}
    gw, _ = gateway_proc(config=config, env=env, auth=True, args=["--workers", "2"])
    with redis, gw:
        [shared] = list(tmp_path.glob("kvgate-workers-*"))
        wait_for(lambda: any(shared.glob("tenancy-state-*.json")), timeout=20,
                 what="the tenancy state kept")
        workers = _children(gw)
        assert gw.popen is not None and len(workers) == 2
        os.kill(gw.popen.pid, signal.SIGKILL)
        wait_for(lambda: all(map(_gone, workers)), timeout=40, what="the workers exited")
        assert not shared.exists(), sorted(p.name for p in shared.iterdir())


def _limit(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return int(resp.headers["x-ratelimit-limit-requests"])


def test_a_worker_restarted_while_redis_is_down_divides_limits_as_its_siblings(
    sim_factory: SimFactory,
) -> None:
    """Three gateway processes share acme's budget (a gateway of 2 workers, another of 1):
    while Redis is down each enforces a third of it, the fleet its routing state last saw.
    A worker started again meanwhile saw no fleet: it divided by its own gateway's 2 workers
    and admitted half the budget alone. It takes its siblings' count."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    config = {**_config(sim), "tiers": {"free": {"limits": {"rpm": 3000}}}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url}
    gw, base = gateway_proc(config=config, env=env, auth=True, args=["--workers", "2"])
    other, _ = gateway_proc(config=config, env=env, auth=True)
    with redis, gw, other:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        auth = {"Authorization": f"Bearer {key}"}

        def chat(c: httpx.Client) -> httpx.Response:
            return c.post(f"{base}/v1/chat/completions", json=BODY, headers=auth)

        def fleet_seen() -> bool:  # each worker heard the 2 others and admitted since
            ready = _by_worker(base, 2, lambda c: c.get(f"{base}/readyz"))
            if any(r.json()["sync"]["peers"] != 2 for r in ready.values()):
                return False
            return all(_limit(r) == 3000 for r in _by_worker(base, 2, chat).values())

        wait_for(fleet_seen, timeout=30, what="both workers to see the fleet of 3")
        time.sleep(1.1)  # the fleet is sampled at most once a second, at an admission
        _by_worker(base, 2, chat)
        redis.stop()
        assert {_limit(r) for r in _by_worker(base, 2, chat).values()} == {1000}
        before = _children(gw)
        os.kill(before[0], signal.SIGKILL)
        wait_for(lambda: len(set(_children(gw)) - {before[0]}) == 2, timeout=20,
                 what="the killed worker started again")
        limits = {_limit(r) for r in _by_worker(base, 2, chat).values()}
        assert limits == {1000}, limits  # 3000 / 3 on both, not 3000 / 2 on the new one
