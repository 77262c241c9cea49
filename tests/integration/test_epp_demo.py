"""`kvgate demo --epp`: the demo behind a real Envoy with kvgate as its endpoint picker; the
printed snippet runs as pasted, and Ctrl-C stops the picker, Envoy and the replicas."""

from __future__ import annotations

import re
import signal
import subprocess

import httpx
import pytest

from tests.support.gateway import wait_for
from tests.support.procs import KVGATE, Proc, free_port


def test_demo_behind_envoy_serves_and_stops_cleanly() -> None:
    port = free_port()
    demo = Proc([*KVGATE, "demo", "--epp", "--port", str(port), "--time-scale", "50"],
                timeout=60)
    with demo:
        wait_for(lambda: "Ctrl-C stops everything." in demo.output(), timeout=60,
                 what="the demo's banner")
        out = demo.output()
        assert "via Envoy -> kvgate epp" in out
        snippet = re.search(r"^\S+ - <<'EOF'\n.*?^EOF$", out, re.S | re.M)
        assert snippet, out
        pasted = subprocess.run(["bash", "-c", snippet.group(0)], capture_output=True,
                                text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert pasted.returncode == 0, pasted.stderr
        replies = pasted.stdout.splitlines()
        assert replies[0].startswith("fp8/") and " demo-8b-fp8 " in replies[0]
        assert replies[1].startswith("awq/") and " demo-70b-awq " in replies[1]
        readyz = re.search(r"readiness: (\S+)", out)
        assert readyz and httpx.get(readyz.group(1), timeout=5).status_code == 200
        demo.signal(signal.SIGINT)
        assert demo.popen is not None and demo.popen.wait(30) == 0
        assert "kvgate demo: stopped" in demo.output()
    with pytest.raises(httpx.ConnectError):  # Envoy is gone too
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
