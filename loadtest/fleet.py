"""Child processes on loopback: simulated replicas and gateways, started, awaited and stopped.

Used by `kvgate demo`, live `kvgate replay --spawn` and the benchmarks. Each process is a
`python -m gateway.cli ...` child; readiness is an HTTP 200 on a probe path.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

__all__ = ["Fleet", "environ", "free_port", "redis_server", "wait_http"]

KVGATE = [sys.executable, "-m", "gateway.cli"]


# Below the kernel's ephemeral range (Linux: 32768-60999 unless configured). A port the
# kernel chose there (bind to port 0) is free only until the caller's child binds it: any
# outgoing connection may take it first as its source port ("address already in use": seen
# on a loaded machine running many clients). Ports below the range are never handed out so.
_LOW_PORT = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A loopback port nothing listens on, below the ephemeral range when it has room there
    (else one the kernel picks)."""
    high = _ephemeral_low()
    if high - _LOW_PORT >= 1000:
        for _ in range(50):
            port = random.randrange(_LOW_PORT, high)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def wait_http(url: str, timeout: float) -> bool:
    """Poll GET `url` until it answers 200 (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ready(url):
            return True
        time.sleep(0.1)
    return False


@dataclass
class Fleet:
    """A set of child processes stopped together (a context manager)."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    quiet: bool = True
    # quiet children's standard error (what a child that exits at start said: `start`)
    _errs: list[IO[bytes]] = field(default_factory=list)

    def start(self, args: Sequence[str], probe: str, timeout: float = 60.0) -> None:
        """Start `kvgate ARGS...` and wait until GET `probe` answers 200. A child that exits
        first is a `RuntimeError` with the end of what it wrote to standard error. The
        ``timeout`` bounds a failed start only (30 s was exceeded on a heavily loaded host)."""
        err: IO[bytes] | None = None
        if self.quiet:
            err = tempfile.TemporaryFile()  # noqa: SIM115 (closed by `stop`)
            self._errs.append(err)
        out = subprocess.DEVNULL if self.quiet else None
        proc = subprocess.Popen([*KVGATE, *args], stdout=out, stderr=err)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                said = ""
                if err is not None:
                    err.seek(0)
                    lines = err.read().decode(errors="replace").strip().splitlines()
                    said = ": " + " / ".join(lines[-3:])[-400:] if lines else ""
                raise RuntimeError(f"kvgate {args[0]} exited with {proc.returncode}{said}")
            if _ready(probe):
                return
            time.sleep(0.05)
        raise TimeoutError(f"kvgate {args[0]} not ready at {probe} after {timeout}s")

    def sim(self, model: str, *extra: str) -> str:
        """Start one simulated replica; returns its base URL."""
        port = free_port()
        self.start(
            ["sim", "--host", "127.0.0.1", "--port", str(port), "--model", model, *extra],
            f"http://127.0.0.1:{port}/health",
        )
        return f"http://127.0.0.1:{port}"

    def gateway(self, upstreams: Sequence[str], *extra: str) -> str:
        """Start `kvgate serve --no-auth` over `upstreams` (one pool); returns its base URL."""
        port = free_port()
        ups = [a for u in upstreams for a in ("--upstream", u)]
        self.start(
            ["serve", "--no-auth", "--host", "127.0.0.1", "--port", str(port), *ups, *extra],
            f"http://127.0.0.1:{port}/readyz",
        )
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
        for f in self._errs:
            f.close()
        self._errs.clear()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (no persistence), its URL once it
    answers; stopped after the block."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (scripts/setup installs it)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        import redis

        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def environ(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set in this process for the block (the children started in it inherit it),
    then put back as it was."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
