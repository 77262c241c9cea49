"""The labels the shipped dashboard and rules read exist on the kvgate metrics they read.

test_observability_assets checks every metric name; a label no metric has (a matcher
`{tenant="x"}` on a metric without `tenant`, a `sum by (tier)` of one) raises no error in
Prometheus: the panel is empty or the alert never fires, in silence. Labels are those of the
table in docs/metrics.md (which tests/integration/test_observability holds to the running
gateway's /metrics), plus the ones Prometheus adds to every scraped series."""

from __future__ import annotations

import re
from typing import Any

import promql_parser
import pytest

from tests.deploy.test_observability_assets import ROOT, _dashboard_exprs, _rules

# added by Prometheus (target labels; kubernetes_sd relabelling commonly adds the pod's), and
# `worker` on every series of a gateway with server.workers > 1 (docs/metrics.md);
# `le`: a histogram's bucket label
SCRAPE_LABELS = {"job", "instance", "pod", "namespace", "container", "node", "service", "le",
                 "worker"}
SUFFIXES = ("_bucket", "_sum", "_count")


def documented_labels() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\|\s*`(kvgate_[a-z0-9_]+)`\s*\|\s*\w+\s*\|\s*([^|]*)\|", text, re.M)
    assert len(rows) >= 15, "docs/metrics.md table not found"
    # "pool, tier, kind (`prompt`, `completion`)": a label's values in parentheses
    return {name: set(re.findall(r"[a-z_]+", re.sub(r"\([^)]*\)", "", labels)))
            for name, labels in rows}


LABELS = documented_labels()


def _metric(name: str) -> str | None:
    """The documented kvgate metric a series name belongs to (a histogram's too)."""
    if name in LABELS:
        return name
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in LABELS:
            return name.removesuffix(suffix)
    return None


def _selectors(node: Any) -> list[Any]:
    found: list[Any] = []

    def visit(n: Any) -> None:
        if isinstance(n, promql_parser.VectorSelector):
            found.append(n)

    promql_parser.walk(node, visit, None)
    return found


def label_problems(expr: str) -> list[str]:
    """Each label the expression reads of a kvgate metric that the metric does not have."""
    grafana_free = expr.replace("$__rate_interval", "5m").replace("$pool", ".*")
    tree = promql_parser.parse(grafana_free)
    problems: list[str] = []
    aggregates: list[Any] = []

    def visit(n: Any) -> None:
        if isinstance(n, promql_parser.VectorSelector):
            metric = _metric(n.name or "")
            for matcher in n.matchers.matchers:
                if metric and matcher.name not in LABELS[metric] | SCRAPE_LABELS | {"__name__"}:
                    problems.append(f"{metric} has no label {matcher.name!r}")
        elif isinstance(n, promql_parser.AggregateExpr) and n.modifier is not None:
            aggregates.append(n)

    promql_parser.walk(tree, visit, None)
    for agg in aggregates:
        metrics = {_metric(s.name or "") for s in _selectors(agg.expr)}
        if None in metrics or len(metrics) != 1:  # recorded series, vLLM's, or a mix
            continue
        (metric,) = metrics
        assert metric is not None
        for label in agg.modifier.labels:
            if label not in LABELS[metric] | SCRAPE_LABELS:
                problems.append(f"{metric} has no label {label!r} (by/without)")
    return problems


def test_a_missing_label_is_caught() -> None:
    assert label_problems('sum by (tenant) (rate(kvgate_request_duration_seconds_count[5m]))')
    assert label_problems('kvgate_redis_up{pool="x"}')
    assert not label_problems('sum by (pool, le) (rate(kvgate_ttft_seconds_bucket[5m]))')


@pytest.mark.parametrize("expr", _dashboard_exprs())
def test_dashboard_queries_read_labels_their_metrics_have(expr: str) -> None:
    assert not label_problems(expr), expr


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r.get("alert") or r.get("record"))
def test_rule_queries_read_labels_their_metrics_have(rule: dict[str, Any]) -> None:
    assert not label_problems(rule["expr"]), rule["expr"]
