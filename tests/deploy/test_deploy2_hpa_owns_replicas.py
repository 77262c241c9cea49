"""A Deployment an HPA scales carries no `replicas` of its own: `kubectl apply -k` sets the
field it declares, so a manifest's `replicas: 3` put an HPA-scaled gateway at 8 pods back to
3 on every apply (a config change at peak took 5 gateways away until the HPA scaled up
again). The starting count is the HPA's `minReplicas`."""

from __future__ import annotations

import pytest

from tests.deploy.test_manifests import built, find


@pytest.mark.parametrize("name", ["base", "overlays/service", "overlays/epp"])
def test_a_scaled_deployment_leaves_its_count_to_the_hpa(name: str) -> None:
    docs = built(name)
    hpas = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpas
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        deployment = find(docs, target["kind"], target["name"])
        assert "replicas" not in deployment["spec"], (name, target["name"])
        assert hpa["spec"]["minReplicas"] >= 2


def test_the_service_overlay_starts_three_gateways() -> None:
    docs = built("overlays/service")
    assert find(docs, "HorizontalPodAutoscaler", "kvgate")["spec"]["minReplicas"] == 3
