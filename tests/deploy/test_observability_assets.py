"""The Grafana dashboard and the Prometheus rules: valid structure, every query parses as
PromQL, and every metric it reads is one kvgate documents (docs/metrics.md) or vLLM exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate.json"
RULES = ROOT / "deploy" / "prometheus" / "kvgate-rules.yaml"
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}

# vLLM V1 metric names as scraped (vLLM 0.34 `vllm/v1/metrics/loggers.py`: counters gain
# `_total`; histograms expose `_bucket`, `_sum`, `_count`).
VLLM_COUNTERS = {
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:num_preemptions_total", "vllm:admission_rejections_total",
}
VLLM_GAUGES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
}
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
}
PROMETHEUS_BUILTIN = {"up"}  # synthesised by Prometheus for every scrape target
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def documented_kvgate_metrics() -> dict[str, str]:
    """name -> type, from the table in docs/metrics.md (the contract)."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\|\s*`(kvgate_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|", text, re.M)
    assert len(rows) >= 15, "docs/metrics.md table not found"
    return dict(rows)


def known_series() -> set[str]:
    names = set(VLLM_COUNTERS | VLLM_GAUGES | PROMETHEUS_BUILTIN)
    hists = set(VLLM_HISTOGRAMS)
    for name, kind in documented_kvgate_metrics().items():
        (hists if kind == "histogram" else names).add(name)
    names |= {h + suffix for h in hists for suffix in HISTOGRAM_SERIES}
    return names


KNOWN = known_series()


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects (raises if it does not parse)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next(
                (m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            assert name, f"selector without a metric name in {expr!r}"
            names.add(name)

    grafana_free = expr.replace("$__rate_interval", "5m").replace("$pool", ".*")
    promql_parser.walk(promql_parser.parse(grafana_free), visit, None)
    return names


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("sum(rate(kvgate_requests_total[5m]))", {"kvgate_requests_total"}),
        ('a / on(pool) b{x="y"}', {"a", "b"}),
        ("histogram_quantile(0.9, sum by (le) (rate(vllm:x_bucket[$__rate_interval])))",
         {"vllm:x_bucket"}),
    ],
)
def test_metric_name_extraction(expr: str, expected: set[str]) -> None:
    assert metric_names(expr) == expected


def test_unknown_names_and_bad_syntax_are_caught() -> None:
    assert "kvgate_ttft_p99" not in KNOWN  # a plausible typo
    assert "vllm:gpu_cache_usage_perc" not in KNOWN  # removed from vLLM
    with pytest.raises(ValueError):
        metric_names("sum(rate(kvgate_requests_total[5m])")


def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dash["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"]
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        assert all(t["expr"].strip() for t in panel["targets"])


def test_dashboard_covers_the_required_views() -> None:
    titles = " | ".join(p["title"].lower() for p in _panels(json.loads(DASHBOARD.read_text())))
    for words in ("ttft", "throughput", "hit rate", "queue depth", "kv-cache usage",
                  "route reasons", "spill-overs", "errors", "rate-limit"):
        assert words in titles, words


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    exprs += [v["definition"].removeprefix("label_values(").split(",")[0]
              for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


@pytest.mark.parametrize("expr", _dashboard_exprs())
def test_dashboard_queries_use_real_metrics(expr: str) -> None:
    unknown = metric_names(expr) - KNOWN
    assert not unknown, f"{unknown} in {expr!r}"


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_rules_structure_and_essentials() -> None:
    doc = yaml.safe_load(RULES.read_text())
    assert {g["name"] for g in doc["groups"]} and all(g["rules"] for g in doc["groups"])
    alerts = {r["alert"]: r for r in _rules() if "alert" in r}
    for name in ("KvgateNoHealthyReplicas", "KvgateHighErrorRatio", "KvgateTTFTp99OverSLO",
                 "KvgateReplicaScrapeStale"):
        assert name in alerts
    for rule in _rules():
        assert ("alert" in rule) != ("record" in rule)
        if "alert" in rule:
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            assert rule["annotations"]["summary"]
            assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s"))
        else:
            assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["record"])
            assert ":" in rule["record"]  # the recording-rule naming convention


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r.get("alert") or r.get("record"))
def test_rule_queries_use_real_metrics(rule: dict[str, Any]) -> None:
    recorded = {r["record"] for r in _rules() if "record" in r}
    unknown = metric_names(rule["expr"]) - KNOWN - recorded
    assert not unknown, f"{unknown} in {rule['expr']!r}"


def test_error_ratios_leave_out_flow_controls_sheds() -> None:
    """A shed request is counted under the pool it was queued for (status 503, route
    `shed`): overload, which `kvgate doctor` reports as the queue's bound, not replica errors.
    The 5xx ratio behind KvgateHighErrorRatio and the dashboard's must leave it out too."""
    rule = next(r for r in _rules() if r.get("record") == "pool:kvgate_request_errors:ratio_rate5m")
    panel = next(p for p in _panels(json.loads(DASHBOARD.read_text()))
                 if p["title"] == "Error ratio (5xx)")
    for expr in (rule["expr"], *(t["expr"] for t in panel["targets"])):
        numerator = expr.split("/")[0]
        assert 'status=~"5.."' in numerator and 'route!="shed"' in numerator, expr
