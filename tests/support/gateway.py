"""Start a real `kvgate serve` on a free loopback port, and read its state from outside.

``gateway_proc(upstreams=[...])`` uses the quick form; ``gateway_proc(config={...})`` writes
the dict as a YAML file (removed when the process stops). Readiness is ``/readyz``. Without
`auth=True` the gateway runs `--no-auth`; with it, pass the secret (and Redis URL) in `env`.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import httpx
import yaml

from tests.support.procs import KVGATE, Proc, free_port

__all__ = ["GatewayProc", "gateway_proc", "inflight", "wait_for"]

# Fast health settings so tests see ejection and recovery within a second or two.
FAST_HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2,
               "eject_base_s": 0.2, "eject_max_s": 1.0}


class GatewayProc(Proc):
    """A `Proc` that also removes its generated config file."""

    config_path: str | None = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        if self.config_path:
            os.unlink(self.config_path)


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
    return proc, base


def metric_values(base: str, name: str) -> dict[str, float]:
    """{label-string: value} for one metric family of the gateway's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


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
