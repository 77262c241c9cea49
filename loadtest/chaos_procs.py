"""The processes of `loadtest.chaos`: one redis-server, simulated replicas and gateways, each
restartable on its own port, its output kept in a log file (the checks read the gateways')."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtest.fleet import free_port, wait_http

__all__ = ["ADMIN", "SALT", "Child", "Procs"]

ADMIN = "chaos-admin-token-7f3a9c1e5b2d4680"  # a throwaway loopback fleet's secrets
SALT = "chaos-salt-secret-0a1b2c3d4e5f6789"


@dataclass
class Child:
    """One child process: its command, its port, its log (appended across restarts)."""

    name: str
    cmd: list[str]
    port: int
    probe: str  # a URL answering 200 once ready ("" for Redis: a TCP connect)
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env})
        self.starts += 1
        if self.probe and not wait_http(self.probe, timeout):
            raise RuntimeError(f"{self.name} not ready at {self.probe}")
        if not self.probe:
            _wait_redis(self.port, timeout)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 40.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        self.wait(15)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def _wait_redis(port: int, timeout: float) -> None:
    import redis

    r = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r.ping()
            return
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on {port} did not answer")


KVGATE = [sys.executable, "-m", "gateway.cli"]


def config(port: int, pools: dict[str, list[str]]) -> dict[str, Any]:
    """Two pools, two tiers with limits (free: tight), flow control and sharing on."""
    return {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "info",
                   "shutdown_grace_s": 10},
        "pools": {name: {"served_model": f"m-{name}", "replicas": urls}
                  for name, urls in pools.items()},
        "models": {"chaos": {"default": "fp8", "premium": "fp8", "free": "awq"}},
        "tiers": {"premium": {"limits": {"rpm": 100000, "max_concurrency": 32},
                              "spill_to": "awq"},
                  "free": {"limits": {"rpm": 600, "max_concurrency": 6}}},
        "health": {"interval_s": 0.5, "timeout_s": 1, "failure_threshold": 2,
                   "eject_base_s": 0.5, "eject_max_s": 2},
        "upstream": {"first_byte_timeout_s": 20, "total_timeout_s": 40},
        "flow": {"enabled": True, "max_queue": 64},
    }


class Procs:
    """redis-server, 2 x 2 simulated replicas (pools fp8, awq), `gateways` gateways."""

    def __init__(self, tmp: Path, gateways: int = 2) -> None:
        self.tmp = tmp
        self.redis = self._redis()
        self.sims = [self._sim(i, "fp8" if i < 2 else "awq") for i in range(4)]
        pools = {"fp8": [s.probe.removesuffix("/health") for s in self.sims[:2]],
                 "awq": [s.probe.removesuffix("/health") for s in self.sims[2:]]}
        self.gateways = [self._gateway(i, pools) for i in range(gateways)]

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis.port}/0"

    def _redis(self) -> Child:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (scripts/setup installs it)")
        port, data = free_port(), self.tmp / "redis"
        data.mkdir()
        # persistent, as in production: a restart keeps tenants, keys and the policy
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data)]
        return Child("redis", cmd, port, "", self.tmp / "redis.log")

    def _sim(self, i: int, pool: str) -> Child:
        port = free_port()
        cmd = [*KVGATE, "sim", "--host", "127.0.0.1", "--port", str(port), "--model",
               f"m-{pool}", "--time-scale", "10", "--seed", str(i)]
        return Child(f"sim{i}", cmd, port, f"http://127.0.0.1:{port}/health",
                     self.tmp / f"sim{i}.log")

    def _gateway(self, i: int, pools: dict[str, list[str]]) -> Child:
        port = free_port()
        path = self.tmp / f"gw{i}.yaml"
        path.write_text(yaml.safe_dump(config(port, pools)))
        env = {"KVGATE_SALT_SECRET": SALT, "KVGATE_ADMIN_TOKEN": ADMIN,
               "KVGATE_REDIS_URL": self.redis_url, "KVGATE_CONFIG": ""}
        return Child(f"gw{i}", [*KVGATE, "serve", "--config", str(path)], port,
                     f"http://127.0.0.1:{port}/readyz", self.tmp / f"gw{i}.log", env)

    def start(self) -> None:
        self.redis.start()
        for c in [*self.sims, *self.gateways]:
            c.start()

    def stop(self) -> None:
        for c in [*self.gateways, *self.sims, self.redis]:
            c.stop()

    def bases(self) -> list[str]:
        return [f"http://127.0.0.1:{g.port}" for g in self.gateways]
