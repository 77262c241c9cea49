"""Start and stop real processes for tests: simulated replicas, gateways, redis-server.

Everything binds to 127.0.0.1 on a free port. A `Proc` is a context manager; on exit it sends
SIGTERM, waits, then SIGKILLs, and its captured output is printed if the test failed to start it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import httpx

from loadtest import fleet
from loadtest.fleet import free_port

# free_port re-exported
__all__ = ["KVGATE", "ROOT", "Proc", "free_port", "port_slice", "redis_proc", "sim_proc",
           "start_sims"]

ROOT = Path(__file__).resolve().parents[2]
KVGATE = [sys.executable, "-m", "gateway.cli"]


class Proc:
    """A child process with captured output and a readiness probe."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        ready_url: str | None = None,
        ready_port: int | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,  # a bound on a failed start only (30 s: seen exceeded, loaded)
    ) -> None:
        self.cmd = list(cmd)
        self.ready_url = ready_url
        self.ready_port = ready_port
        self.env = {**os.environ, **(env or {})}
        self.timeout = timeout
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in __exit__
            prefix="kvgate-test-", suffix=".log", delete=False
        )
        # a Proc a test starts and stops by hand (no `with`), or never starts, leaves no file
        self._files: list[Callable[[], object]] = [weakref.finalize(self, _remove_log, self._log)]
        self.popen: subprocess.Popen[bytes] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Proc:
        if self.popen is not None and self.popen.poll() is None:
            return self  # running (`with proc.start():` must not start a second, left running)
        self.popen = subprocess.Popen(
            self.cmd, cwd=ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                code = self.popen.returncode
                raise RuntimeError(f"process exited early ({code}):\n{self.output()}")
            if self._is_ready():
                return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"process not ready after {self.timeout}s:\n{self.output()}")

    def _is_ready(self) -> bool:
        if self.ready_url is not None:
            try:
                return httpx.get(self.ready_url, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False
        if self.ready_port is not None:
            try:
                with socket.create_connection(("127.0.0.1", self.ready_port), timeout=0.5):
                    return True
            except OSError:
                return False
        return True

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def output(self, tail: int | None = 8000) -> str:
        """The last `tail` characters of what the process wrote (None: all of it)."""
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def __enter__(self) -> Proc:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop it and remove its files (what leaving its ``with`` block does)."""
        self.stop()
        for remove in self._files:
            remove()

    def owns(self, path: str) -> None:
        """Remove the file at ``path`` (a generated config) with the process's own files: on
        exit, or when the Proc is collected."""
        self._files.append(weakref.finalize(self, _remove, path))


def _remove_log(log: IO[bytes]) -> None:
    log.close()
    _remove(log.name)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def port_slice(worker: str | None, count: str | None) -> None:
    """Give this test process a share of the ports `free_port` draws from, apart from the other
    pytest-xdist workers' (`worker` "gw3" of `count` "4"; None: not under xdist, all of them).

    `free_port` only proves a port free when it picks it; the child that binds it starts
    later, and another worker's pick in between could be the same port. A worker drawing from
    its own slice cannot collide so. The slice is of the range below the kernel's ephemeral
    ports (`loadtest.fleet._LOW_PORT` to its low end), the module's two private bounds set
    here because only tests split it.
    """
    if not worker or not count or not worker.startswith("gw"):
        return
    index, total = int(worker[2:]), int(count)
    low, high = fleet._LOW_PORT, fleet._ephemeral_low()
    if total < 1 or not 0 <= index < total or (high - low) // total < 1000:
        return  # too few ports for a useful slice each: the whole range, as before
    width = (high - low) // total
    fleet._LOW_PORT = low + index * width
    end = fleet._LOW_PORT + width
    fleet._ephemeral_low = lambda: end


def sim_proc(port: int | None = None, *args: str, model: str = "sim-model") -> tuple[Proc, str]:
    """A `kvgate sim` replica (not started). Returns (proc, base_url)."""
    port = port or free_port()
    cmd = [*KVGATE, "sim", "--host", "127.0.0.1", "--port", str(port), "--model", model, *args]
    url = f"http://127.0.0.1:{port}"
    return Proc(cmd, ready_url=f"{url}/health"), url


def start_sims(
    procs: list[Proc], n: int, *args: str, model: str = "sim-model",
) -> tuple[list[Proc], list[str]]:
    """Start `n` `kvgate sim` replicas with `args`, one after the other, each appended to
    `procs` once started (the caller stops them). Returns their procs and base URLs."""
    sims, urls = [], []
    for _ in range(n):
        sim, url = sim_proc(None, *args, model=model)
        procs.append(sim.start())
        sims.append(sim)
        urls.append(url)
    return sims, urls


def redis_proc(port: int | None = None) -> tuple[Proc, str]:
    """A throwaway redis-server without persistence (not started). Returns (proc, redis_url)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed; run scripts/setup")
    port = port or free_port()
    # a directory of its own: in the repository (the cwd) a Redis loaded any dump.rdb found
    # there at start, and a replica (tests/unit/tenancy/test_redis_causes.py) wrote one there,
    # so every later test's Redis began with that test's keys (kvgate:routes a string)
    data = tempfile.mkdtemp(prefix="kvgate-test-redis-")
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", data]
    # removed when the tests end, not with this Proc: callers build others from its command
    atexit.register(shutil.rmtree, data, True)
    return Proc(cmd, ready_port=port), f"redis://127.0.0.1:{port}/0"
