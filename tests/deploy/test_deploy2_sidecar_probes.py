"""The sidecar overlay's probes, run as the kubelet runs them, against a real `kvgate serve`
whose only replica does not answer yet (a vLLM pod still loading its weights).

The startup probe gates the app container (a native sidecar's must pass before the app
starts) and a failing one restarts kvgate: it must pass once kvgate listens, not wait for a
pool (it polled /readyz, so kvgate was restarted in a loop, with back-off, for as long as the
pool loaded and the app could not start). /readyz is the readiness probe's.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests.deploy.test_manifests import built, find
from tests.support.gateway import gateway_proc
from tests.support.procs import free_port

SIDECAR_PORT = 8000  # the sidecar config's server.port, which the probes name


def _sidecar() -> dict[str, Any]:
    app = find(built("overlays/sidecar"), "Deployment", "chat-app")["spec"]["template"]["spec"]
    (sidecar,) = app["initContainers"]
    assert isinstance(sidecar, dict)
    return sidecar


def _run(probe: dict[str, Any], port: int) -> int:
    """The probe's exec command with the image's `python` (this one) and the test's port."""
    command = [str(c).replace(f":{SIDECAR_PORT}/", f":{port}/") for c in probe["exec"]["command"]]
    assert command[0] == "python"
    return subprocess.run([sys.executable, *command[1:]], capture_output=True,
                          timeout=30).returncode


@pytest.fixture(scope="module")
def not_ready_gateway() -> Any:
    proc, base = gateway_proc(upstreams=[f"http://127.0.0.1:{free_port()}"], ready=False)
    with proc:
        yield int(base.rsplit(":", 1)[1])


def test_the_startup_probe_passes_while_no_pool_is_ready(not_ready_gateway: int) -> None:
    assert _run(_sidecar()["startupProbe"], not_ready_gateway) == 0


def test_the_readiness_probe_says_not_ready_then(not_ready_gateway: int) -> None:
    sidecar = _sidecar()
    assert "readinessProbe" in sidecar
    assert _run(sidecar["readinessProbe"], not_ready_gateway) != 0
    assert _run(sidecar["livenessProbe"], not_ready_gateway) == 0
