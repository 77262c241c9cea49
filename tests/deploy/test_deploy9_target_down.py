"""KvgateTargetDown fires for the shipped manifests' pods under annotation-based discovery.

The manifests ask to be scraped through `prometheus.io/*` annotations, which the common
`kubernetes-pods` scrape job discovers; its job name holds no "kvgate", so an alert selecting
on the job alone never fired for them. The usual relabelling maps each pod label to a target
label (`app.kubernetes.io/name` -> `app_kubernetes_io_name`): the alert selects on that too."""

from __future__ import annotations

import re

import promql_parser
import yaml

from tests.deploy.test_observability_assets import ROOT, _rules


def _selectors(expr: str) -> list[dict[str, str]]:
    """Each `up{...}` selector's equality matchers of a rule's expression."""
    found: list[dict[str, str]] = []
    text = str(promql_parser.parse(expr))  # it parses
    for body in re.findall(r"\bup\{([^}]*)\}", text):
        found.append(dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', body)))
    return found


def test_target_down_selects_the_pods_of_the_shipped_deployment() -> None:
    alert = next(r for r in _rules() if r.get("alert") == "KvgateTargetDown")
    deployment = yaml.safe_load((ROOT / "deploy" / "base" / "deployment.yaml").read_text())
    template = deployment["spec"]["template"]["metadata"]
    assert template["annotations"]["prometheus.io/scrape"] == "true"
    mapped = {re.sub(r"[^A-Za-z0-9_]", "_", k): v for k, v in template["labels"].items()}
    assert any(sel and all(mapped.get(k) == v for k, v in sel.items())
               for sel in _selectors(alert["expr"])), alert["expr"]
