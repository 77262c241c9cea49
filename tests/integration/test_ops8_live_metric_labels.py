"""Every label a running gateway's kvgate_* series carry is one docs/metrics.md gives their
metric (the table the shipped dashboard and rules are checked against:
tests/deploy/test_ops8_alert_labels.py). Families were held to the table by name and type only:
a label renamed in the code (`tier` -> `tier_name`) would have left every panel and alert
reading the old one empty, with every test green."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__
from tests.deploy.test_ops8_alert_labels import LABELS, _metric
from tests.integration.test_observability import Stack, stack, traffic  # noqa: F401


def test_live_series_carry_only_documented_labels(traffic: Stack) -> None:  # noqa: F811
    text = httpx.get(f"{traffic.gateway}/metrics", timeout=5).text
    undocumented: dict[str, set[str]] = {}
    checked = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            metric = _metric(sample.name)
            if metric is None:
                continue
            checked += 1
            extra = set(sample.labels) - LABELS[metric] - {"le"}
            if extra:
                undocumented.setdefault(metric, set()).update(extra)
    assert checked > 50
    assert not undocumented, undocumented


def test_the_running_release_is_exported(traffic: Stack) -> None:  # noqa: F811
    """`kvgate_build_info{version}`: which release each gateway runs (a rolling upgrade's
    skew, or one stuck half way, shows as two values)."""
    text = httpx.get(f"{traffic.gateway}/metrics", timeout=5).text
    builds = [s for f in text_string_to_metric_families(text) if f.name == "kvgate_build_info"
              for s in f.samples]
    assert [(s.labels, s.value) for s in builds] == [({"version": __version__}, 1.0)]
