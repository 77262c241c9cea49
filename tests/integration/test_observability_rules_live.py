"""The gauge alerts of deploy/prometheus/kvgate-rules.yaml evaluated against a live gateway's
/metrics page, as Prometheus would evaluate them at one instant (their ``for:`` aside).

A small evaluator covers the PromQL these rules use on gauges (selectors, ``max``/``min``/
``sum by``, comparisons with a number, ``and``/``or``/``unless`` with ``on``): enough to ask
"would this alert be pending now, and for which series?" without a Prometheus here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx
import promql_parser as pq
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_observability_assets import ROOT, _rules
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, redis_proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">": lambda a, b: a > b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
_AGGREGATE: dict[str, Callable[[list[float]], float]] = {"max": max, "min": min, "sum": sum}
# a recording rule's name in an alert stands for its expression
_RECORDED = {str(r["record"]): str(r["expr"]) for r in _rules() if "record" in r}


def _page(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def _select(node: pq.VectorSelector, page: list[tuple[str, dict[str, str], float]]) -> Vector:
    out: Vector = {}
    for name, labels, value in page:
        if name != node.name:
            continue
        ok = True
        for m in node.matchers.matchers:
            have, op = labels.get(m.name, ""), str(m.op).rsplit(".", 1)[-1]
            match = {"Equal": have == m.value, "NotEqual": have != m.value,
                     "Re": re.fullmatch(m.value, have) is not None,
                     "NotRe": re.fullmatch(m.value, have) is None}[op]
            ok = ok and match
        if ok:
            out[frozenset(labels.items())] = value
    return out


def _keep(labels: Labels, names: list[str]) -> Labels:
    return frozenset((k, v) for k, v in labels if k in names)


def evaluate(node: object, page: list[tuple[str, dict[str, str], float]]) -> Vector | float:
    """`node`'s instant value over `page` (a vector, or a number)."""
    if isinstance(node, pq.ParenExpr):
        return evaluate(node.expr, page)
    if isinstance(node, pq.NumberLiteral):
        return float(node.val)
    if isinstance(node, pq.VectorSelector):
        if node.name in _RECORDED:
            return evaluate(pq.parse(_RECORDED[node.name]), page)
        return _select(node, page)
    if isinstance(node, pq.AggregateExpr):
        inner = evaluate(node.expr, page)
        assert isinstance(inner, dict) and node.modifier is not None
        groups: dict[Labels, list[float]] = {}
        for labels, value in inner.items():
            groups.setdefault(_keep(labels, node.modifier.labels), []).append(value)
        return {k: _AGGREGATE[str(node.op)](v) for k, v in groups.items()}
    assert isinstance(node, pq.BinaryExpr), f"not covered here: {node}"
    return _binary(node, evaluate(node.lhs, page), evaluate(node.rhs, page))


def _binary(node: pq.BinaryExpr, lhs: Vector | float, rhs: Vector | float) -> Vector:
    op = str(node.op)
    if op in _COMPARE:  # a filter: vector against a number
        assert isinstance(lhs, dict) and isinstance(rhs, float), node
        return {k: v for k, v in lhs.items() if _COMPARE[op](v, rhs)}
    assert isinstance(lhs, dict) and isinstance(rhs, dict), node
    on = node.modifier.matching.labels if node.modifier and node.modifier.matching else None

    def key(labels: Labels) -> Labels:
        return labels if on is None else _keep(labels, on)

    right = {key(k) for k in rhs}
    if op == "unless":
        return {k: v for k, v in lhs.items() if key(k) not in right}
    if op == "and":
        return {k: v for k, v in lhs.items() if key(k) in right}
    assert op == "or", node
    left = {key(k) for k in lhs}
    return {**lhs, **{k: v for k, v in rhs.items() if key(k) not in left}}


def _alert(name: str) -> str:
    return str(next(r["expr"] for r in _rules() if r.get("alert") == name))


def _panel_expr(title: str) -> str:
    dash = json.loads((ROOT / "deploy" / "grafana" / "kvgate.json").read_text())
    panels = [p for row in dash["panels"] for p in (row, *row.get("panels", []))]
    return str(next(p for p in panels if p["title"] == title)["targets"][0]["expr"])


def firing(expr: str, base: str) -> set[str]:
    """The replicas (``pool/replica``) `expr` returns a series for, over `base`'s page."""
    result = evaluate(pq.parse(expr), _page(httpx.get(f"{base}/metrics", timeout=5).text))
    assert isinstance(result, dict)
    return {f"{dict(k).get('pool')}/{dict(k).get('replica')}" for k in result}


def test_no_healthy_replicas_alert_covers_a_pool_left_empty(sim_factory: SimFactory) -> None:
    """A pool whose discovery finds no replica (a Kubernetes Service with no ready pod; here a
    DNS name that resolves to nothing) answers 503 to every request, yet had no series in
    `kvgate_replica_healthy` for the critical alert to count as 0: it never fired."""
    _, good = sim_factory("--time-scale", "50")
    empty = {"dns": {"name": "no-replica.invalid", "port": 8000, "interval_seconds": 1}}
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [good]},
                        "e": {"served_model": "other", "discovery": empty}}}
    gw, base = gateway_proc(config=config, ready=False)
    with gw:
        wait_for(lambda: bool(firing("kvgate_replica_healthy == 1", base)), timeout=30,
                 what="the listed replica healthy")
        assert firing(_alert("KvgateNoHealthyReplicas"), base) == {"e/None"}
        panel = _panel_expr("Healthy replicas per pool").replace("$pool", ".*")
        assert firing(panel, base) == {"e/None", "p/None"}  # the dashboard shows it as 0
        assert metric_values(base, "kvgate_pool_healthy_replicas") == {
            '{pool="e"}': 0.0, '{pool="p"}': 1.0}


def test_the_evaluator_on_known_expressions() -> None:
    page = [("g", {"pool": "a", "replica": "1", "worker": "0"}, 5.0),
            ("g", {"pool": "a", "replica": "1", "worker": "1"}, 40.0),
            ("g", {"pool": "b", "replica": "2"}, 1.0), ("h", {"pool": "b", "replica": "2"}, 1.0)]
    assert evaluate(pq.parse("max by (pool, replica) (g) > 30"), page) == {
        frozenset({("pool", "a"), ("replica", "1")}): 40.0}
    unless = evaluate(pq.parse("g unless on (pool, replica) h"), page)
    assert isinstance(unless, dict) and unless.keys() == {
        frozenset({("pool", "a"), ("replica", "1"), ("worker", w)}) for w in "01"}
    assert evaluate(pq.parse('sum by (pool) (g{replica=~"1|2"}) < 2'), page) == {
        frozenset({("pool", "b")}): 1.0}


def test_scrape_stale_alert_covers_a_replica_never_scraped(sim_factory: SimFactory) -> None:
    """A replica whose /metrics never answered (a proxy in front of vLLM that routes `/v1`
    only) has no `kvgate_replica_scrape_age_seconds` series at all: the alert read only that
    gauge, so the replica whose load kvgate never saw was the one it never named."""
    _, good = sim_factory("--time-scale", "50")
    _, blind = sim_factory("--time-scale", "50")
    httpx.post(f"{blind}/sim/faults", json={"metrics_status": 404}).raise_for_status()
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [good, blind]}},
              "routing": {"scrape_interval_ms": 100}}
    gw, base = gateway_proc(config=config)
    with gw:
        blind_id, good_id = (f"p/{u.removeprefix('http://')}" for u in (blind, good))

        def scraped() -> bool:  # the good one read, the blind one tried more than once
            errors = metric_values(base, "kvgate_scrape_errors_total")
            ages = metric_values(base, "kvgate_replica_scrape_age_seconds")
            return (sum(errors.values()) >= 3
                    and any(good_id.split("/")[1] in k for k in ages))

        wait_for(scraped, timeout=30, what="scrapes of both replicas")
        expr = _alert("KvgateReplicaScrapeStale")
        assert firing(expr, base) == {blind_id}
        # served all the same, and not named as down: only its load is unknown
        assert firing("kvgate_replica_healthy == 1", base) == {blind_id, good_id}
        httpx.post(f"{blind}/sim/faults", json={"metrics_status": 0}).raise_for_status()
        wait_for(lambda: not firing(expr, base), timeout=30, what="the alert to clear")


def test_shared_state_alert_fires_while_redis_is_gone(sim_factory: SimFactory) -> None:
    """`KvgateSharedRoutingStateDown`: a gateway routing on its own state only (the shared
    routing state's Redis gone) is named, and not while Redis answers."""
    _, sim = sim_factory("--time-scale", "50")
    redis, url = redis_proc()
    with redis:
        gw, base = gateway_proc(config={"pools": {"p": {"served_model": MODEL,
                                                        "replicas": [sim]}}},
                                env={"KVGATE_REDIS_URL": url, "KVGATE_ADMIN_TOKEN": "x" * 32})
        with gw:
            expr = _alert("KvgateSharedRoutingStateDown")
            wait_for(lambda: metric_values(base, "kvgate_sync_up") == {"": 1.0}, timeout=30,
                     what="sharing up")
            assert not firing(expr, base)
            redis.stop()
            wait_for(lambda: metric_values(base, "kvgate_sync_up") == {"": 0.0}, timeout=30,
                     what="sharing down")
            assert firing(expr, base) == {"None/None"}
