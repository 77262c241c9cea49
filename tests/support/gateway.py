"""Start a real `kvgate serve` on a free loopback port, and read its state from outside.

``gateway_proc(upstreams=[...])`` uses the quick form; ``gateway_proc(config={...})`` writes
the dict as a YAML file (removed when the process stops). Readiness is ``/readyz``. Without
`auth=True` the gateway runs `--no-auth`; with it, pass the secret (and Redis URL) in `env`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import yaml

from tests.support.procs import KVGATE, Proc, free_port, sim_proc

__all__ = [
    "AUTH_SECRET",
    "GatewayProc",
    "admin_client",
    "gateway_proc",
    "inflight",
    "persistent_redis",
    "shared_gateways",
    "wait_for",
]

AUTH_SECRET = "e2e-salt-secret-0123456789abcdef"  # tests only

# Fast health settings so tests see ejection and recovery within a second or two.
FAST_HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2,
               "eject_base_s": 0.2, "eject_max_s": 1.0}


class GatewayProc(Proc):
    """A `Proc` whose generated config file (`config_path`) it owns (`Proc.owns`)."""

    config_path: str | None = None


def gateway_proc(
    *,
    upstreams: Sequence[str] = (),
    config: dict[str, Any] | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready: bool = True,
    auth: bool = False,
    port: int | None = None,
) -> tuple[GatewayProc, str]:
    """A gateway (not started). Returns (proc, base_url without /v1)."""
    port = port or free_port()
    cmd = [*KVGATE, "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    if not auth:
        cmd.append("--no-auth")
    path = None
    if config is not None:
        cfg = {"health": FAST_HEALTH, **config}
        fd, path = tempfile.mkstemp(prefix="kvgate-test-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f)
        cmd += ["--config", path]
    for url in upstreams:
        cmd += ["--upstream", url]
    base = f"http://127.0.0.1:{port}"
    fast_env = {f"KVGATE_HEALTH__{k.upper()}": str(v) for k, v in FAST_HEALTH.items()}
    env = {**(fast_env if config is None else {}), "KVGATE_CONFIG": "", "KVGATE_SALT_SECRET": "",
           "KVGATE_REDIS_URL": "", "KVGATE_ADMIN_TOKEN": "", **(env or {})}
    proc = GatewayProc(cmd, ready_url=f"{base}/readyz" if ready else f"{base}/healthz", env=env)
    proc.config_path = path
    if path is not None:
        proc.owns(path)
    return proc, base


def admin_client(base: str, token: str | None) -> httpx.Client:
    """An httpx client for the admin API (close it, or use it as a context manager)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=f"{base}/admin", headers=headers, timeout=10)


def persistent_redis(data_dir: str, port: int | None = None) -> tuple[Proc, str, int]:
    """redis-server with an append-only file, so a restart on the same port keeps the data
    (as in production). Returns (proc, url, port)."""
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is not installed; run scripts/setup"
    port = port or free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
           "--appendfsync", "always", "--dir", data_dir]
    return Proc(cmd, ready_port=port), f"redis://127.0.0.1:{port}/0", port


def metric_values(base: str, name: str) -> dict[str, float]:
    """{label-string: value} for one metric family of the gateway's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def request_statuses(base: str) -> dict[str, float]:
    """{status: requests} of the gateway's kvgate_requests_total, summed over the other
    labels."""
    out: dict[str, float] = {}
    for labels, value in metric_values(base, "kvgate_requests_total").items():
        status = labels.split('status="')[1].split('"')[0]
        out[status] = out.get(status, 0.0) + value
    return out


def shared_gateways(procs: list[Proc], redis_url: str, admin_token: str,
                    config: dict[str, Any], n: int = 2) -> list[str]:
    """Start `n` gateways with authentication on, sharing `redis_url`, each appended to
    `procs` (the caller stops them); their base URLs."""
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": admin_token,
           "KVGATE_REDIS_URL": redis_url}
    bases = []
    for _ in range(n):
        gw, base = gateway_proc(config=config, env=env, auth=True)
        procs.append(gw.start())
        bases.append(base)
    return bases


def acme_gateway(
    sim: str, redis_url: str, admin_token: str, limits: dict[str, Any],
    tenancy: dict[str, Any] | None = None,
) -> tuple[GatewayProc, str]:
    """A gateway with authentication on: one pool on `sim` (served "m", public "llama"), the
    tenant `acme` in tier `free` with `limits`, state in `redis_url` (not started)."""
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": limits}},
        "tenants": [{"id": "acme", "tier": "free"}],
        **({"tenancy": tenancy} if tenancy else {}),
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": admin_token,
           "KVGATE_REDIS_URL": redis_url}
    return gateway_proc(config=config, env=env, auth=True)


def chat_status(client: openai.OpenAI, model: str = "llama") -> int:
    """The HTTP status of one small chat completion (an error status, not an exception)."""
    try:
        return client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ).status_code
    except openai.APIStatusError as exc:
        return exc.status_code


def inflight(base: str) -> float:
    """Total requests the gateway counts as in flight over all replicas."""
    return sum(metric_values(base, "kvgate_inflight_requests").values())


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `condition` until true, failing the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def unread_chat(port: int, body: dict[str, Any]) -> socket.socket:
    """POST ``body`` to the gateway's chat route on a socket with a tiny receive buffer, and
    leave the answer unread (a client that stopped reading)."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
              b"content-length: %d\r\n\r\n" % len(data) + data)
    return s


@contextmanager
def two_tier_gateway(premium_model: str, admin: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A gateway with authentication before one simulated replica: the public model `open`
    for every tier and `premium_model` for the premium tier only. Yields (base URL,
    {"default": a key of the default tier, "premium": one of the premium tier, "sim": the
    replica's URL})."""
    sim, url = sim_proc(None, "--time-scale", "50", model="sim-model")
    config = {
        "pools": {"p": {"served_model": "sim-model", "replicas": [url]}},
        "models": {"open": {"default": "p"}, premium_model: {"premium": "p"}},
        "tiers": {"premium": {}},
        "tenants": [{"id": "basic", "tier": "default"}, {"id": "gold", "tier": "premium"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": admin}
    with sim:
        gw, base = gateway_proc(config=config, env=env, auth=True)
        with gw, admin_client(base, admin) as client:
            made = {tier: client.post(f"/tenants/{tenant}/keys").json()["key"]
                    for tier, tenant in (("default", "basic"), ("premium", "gold"))}
            yield base, {**made, "sim": url}
