"""The kvgate pod's termination grace is spent letting streams finish: after the preStop
sleep, kvgate drains for `server.shutdown_grace_s` of its mounted config, which must end
before the kubelet's SIGKILL and use most of the time the pod is given. The base gave the
pod 120 s "for long streams" while its config kept the 30 s default: every stream still
running 35 s after SIGTERM was cut, 85 s before the pod had to go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import load_config
from tests.deploy.test_manifests import built, find

MARGIN_S = 15  # what may be left for the process to exit after its drain


@pytest.mark.parametrize("name", ["base", "overlays/service", "overlays/epp"])
def test_kvgate_drains_for_the_pods_grace(name: str, tmp_path: Path) -> None:
    docs = built(name)
    path = tmp_path / "config.yaml"
    path.write_text(find(docs, "ConfigMap", "kvgate-config")["data"]["config.yaml"])
    grace = load_config(str(path), environ={}).server.shutdown_grace_s
    spec: dict[str, Any] = find(docs, "Deployment", "kvgate")["spec"]["template"]["spec"]
    pod_grace = spec["terminationGracePeriodSeconds"]
    (container,) = spec["containers"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop + grace < pod_grace
    assert pre_stop + grace >= pod_grace - MARGIN_S
