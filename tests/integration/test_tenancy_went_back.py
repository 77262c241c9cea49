"""Redis restarted from a snapshot older than its last writes (RDB persistence, Redis's
default, loses what was written since its last save on a crash; a backup restored): the
store keeps its bootstrap marker, so it is no wipe, but it went back. The gateways followed it
without a word: a key revoked since worked again, a key made since got 401, and /readyz said
all was well. Now each gateway says so once, naming the keys by id, counts it and reports
degraded. Real processes: redis-server (SAVE, SIGKILL, restarted from its RDB file), the
simulator, two gateways, the openai client."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import orjson

from tests.support.gateway import AUTH_SECRET, admin_client, chat_status, gateway_proc, wait_for
from tests.support.procs import Proc, free_port, redis_proc

ADMIN = "went-back-admin-token-0123456789"


def _redis(port: int, data: Path) -> Proc:
    """redis-server saving only when told (SAVE), to an RDB file in `data`."""
    proc, _ = redis_proc(port)
    return Proc([*proc.cmd, "--dir", str(data), "--dbfilename", "dump.rdb"], ready_port=port)


def _status(base: str, key: str) -> int:
    return chat_status(openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0))


def _answers(base: str, key: str, status: int) -> Callable[[], bool]:
    return lambda: _status(base, key) == status


def _errors(gw: Proc) -> list[str]:
    return [doc["msg"] for line in gw.output(tail=None).splitlines() if line.startswith("{")
            and (doc := orjson.loads(line))["level"] == "error"]


def test_a_store_back_from_an_older_snapshot_is_said_and_named(
    sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc], tmp_path: Path,
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    port = free_port()
    redis = _redis(port, tmp_path)
    procs.append(redis.start())
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}}}
    env = {"KVGATE_REDIS_URL": f"redis://127.0.0.1:{port}/0",
           "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gateways = [gateway_proc(config=config, env=env, auth=True) for _ in range(2)]
    procs.extend(gw.start() for gw, _ in gateways)
    bases = [base for _, base in gateways]
    with admin_client(bases[0], ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "t", "tier": "default"}).status_code == 201
        old = admin.post("/tenants/t/keys").json()
        subprocess.run(["redis-cli", "-p", str(port), "SAVE"], check=True, timeout=30,
                       capture_output=True)
        assert admin.delete(f"/tenants/t/keys/{old['id']}").status_code == 204
        new = admin.post("/tenants/t/keys").json()
    for base in bases:
        wait_for(_answers(base, new["key"], 200), 30, "the new key everywhere")
        assert _status(base, old["key"]) == 401
    redis.kill()  # Redis crashes: the revocation and the new key were never saved
    procs.append(_redis(port, tmp_path).start())
    for gw, base in gateways:
        # the store's truth: it is what the admin API reads and writes
        wait_for(_answers(base, old["key"], 200), 30, "the snapshot in force")
        ready = httpx.get(f"{base}/readyz", timeout=5).json()
        assert ready["degraded"] and ready["tenancy"]["store_resets"] == 1, ready
        reason = ready["tenancy"]["reason"]
        assert "went back" in reason and f"t/{old['id']}" in reason, reason
        said = [m for m in _errors(gw) if "went back" in m]
        assert len(said) == 1, said
        assert f"revoked since work again (t/{old['id']}" in said[0], said
        assert f"made since are gone (t/{new['id']}" in said[0], said
        assert old["key"] not in gw.output(tail=None) and new["key"] not in said[0]
