"""`listening on ...` is logged once the gateway serves, after its start-up: a start that
fails in its start-up (here the tenancy store's policy follows Kubernetes, and this gateway
runs outside a cluster) never claimed to listen. It was logged before the start-up began."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import orjson
import yaml

from gateway.policy_doc import parse_policy
from gateway.tenancy import RedisStore, connect_redis
from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import KVGATE, ROOT, free_port

ADMIN = "listening-line-admin-token-0123"


async def _store_policy_following_kubernetes(redis_url: str) -> None:
    store = RedisStore(connect_redis(redis_url, timeout_s=5), listen=False)
    try:
        await store.put_policy(parse_policy({
            "pools": {"p": {"served_model": "m", "discovery": {"kubernetes": {"service": "v"}}}},
            "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}}))
    finally:
        await store.close()


def _messages(output: str) -> list[str]:
    return [orjson.loads(line)["msg"] for line in output.splitlines() if line.startswith("{")]


def test_a_start_that_fails_never_said_it_listened(redis_url: str, tmp_path: Path) -> None:
    asyncio.run(_store_policy_following_kubernetes(redis_url))
    port = free_port()
    config = tmp_path / "k.yaml"  # passes `kvgate config check`: the store's policy wins
    config.write_text(yaml.safe_dump({
        "pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}))
    env = {"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": "", "KVGATE_SALT_SECRET": AUTH_SECRET,
           "KVGATE_REDIS_URL": redis_url, "KVGATE_ADMIN_TOKEN": ADMIN}
    result = subprocess.run([*KVGATE, "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--config", str(config)], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode != 0
    msgs = _messages(result.stderr + result.stdout)
    assert "Application startup failed. Exiting." in msgs, msgs
    assert not any(m.startswith("listening on") for m in msgs), msgs


def test_a_start_that_succeeds_says_it_listens_once_started() -> None:
    gw, _ = gateway_proc(upstreams=["http://127.0.0.1:9"], ready=False)
    with gw:
        gw.stop()
        msgs = _messages(gw.output())
    said = [i for i, m in enumerate(msgs) if m.startswith("listening on")]
    assert len(said) == 1, msgs
    assert msgs.index("Application startup complete.") < said[0], msgs


def test_workers_say_it_once_when_they_all_serve(redis_url: str) -> None:
    gw, _ = gateway_proc(upstreams=["http://127.0.0.1:9"], ready=False, args=["--workers", "2"],
                         env={"KVGATE_REDIS_URL": redis_url})
    with gw:  # (the supervisor sees its workers serving within its poll interval)
        wait_for(lambda: "\"msg\":\"listening on" in gw.output(), what="the listening line")
        gw.stop()
        msgs = _messages(gw.output())
    said = [i for i, m in enumerate(msgs) if m.startswith("listening on")]
    assert len(said) == 1, msgs
    started = [i for i, m in enumerate(msgs) if m == "Application startup complete."]
    assert len(started) == 2 and max(started) < said[0], msgs
