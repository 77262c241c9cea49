"""The report: cache return verdicts, text rendering, the CLI's argument errors, the documented
threshold table, and a whole report built from a history (JSON without NaN)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.doctor import cli
from gateway.doctor.cache import LITTLE, PAYS, TOO_LITTLE, UNKNOWN, cache_return
from gateway.doctor.findings import Context
from gateway.doctor.render import format_duration, parse_duration, render_cache, render_findings
from gateway.doctor.service import Doctor, DoctorSettings
from gateway.doctor.thresholds import Thresholds, markdown_table
from gateway.doctor.window import GatewayStats, PoolStats, ReplicaStats, TenantStats, Window
from tests.unit.doctor.test_history import Fleet, _ticks

ROOT = Path(__file__).resolve().parents[3]
TH = Thresholds()


def test_docs_show_the_threshold_table_of_the_code() -> None:
    text = (ROOT / "docs" / "doctor.md").read_text()
    m = re.search(r"<!-- thresholds table[^>]*-->\n(.*?)\n<!-- end of the thresholds table -->",
                  text, re.S)
    assert m is not None
    assert m.group(1) == markdown_table()


@pytest.mark.parametrize(("text", "seconds"), [
    ("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), ("90", 90.0), ("500ms", 0.5), (" 2.5m ", 150.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "5x", "-1s", "0s", "25h", "5 m s", "1e3s", "\u0663m", "\uff15m"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid window"):
        parse_duration(text)


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0.001, 0.4, 30, 300, 330, 3900)] == [
        "1ms", "0.4s", "30s", "5m", "5m30s", "1h05m"]


def _window(tenants: list[TenantStats], replicas: list[ReplicaStats]) -> Window:
    p = PoolStats("p")
    p.replicas = replicas
    return Window(300, 300, 0, 300, 300, replicas, [p], GatewayStats(), tenants, 300.0)


def test_cache_verdicts_per_tenant() -> None:
    r = ReplicaStats("r", "p", prefill_rate=10_000.0, kv_mean=0.6, queries=1e6, hits=4e5,
                     prompt_tokens=1e6, requests=400.0)
    tenants = [
        TenantStats("chat", "p", 100, 200_000, 120_000, 100),  # 60 %: pays
        TenantStats("rag", "p", 100, 300_000, 51_200, 100),  # a 512-token shared prefix
        TenantStats("old", "p", 100, 200_000, 0, 0),  # no cached_tokens reported
        TenantStats("mixed", "p", 100, 200_000, 30_000, 55),  # by some replicas only
        TenantStats("tiny", "p", 3, 900, 800, 3),
    ]
    rows, pools = cache_return(_window(tenants, [r]), TH)
    by = {row.tenant: row for row in rows}
    assert by["chat"].verdict == PAYS and by["chat"].gpu_seconds_saved == pytest.approx(12.0)
    assert by["rag"].verdict == LITTLE and "~512 of ~3,000 prompt tokens" in by["rag"].detail
    assert by["old"].verdict == UNKNOWN and by["old"].hit_rate is None
    assert by["old"].detail == "cached_tokens missing from the answers' usage"
    assert by["mixed"].verdict == UNKNOWN and by["mixed"].hit_rate is None
    assert by["mixed"].detail.startswith("only 55% of the answers' usage carried cached_tokens")
    assert by["tiny"].verdict == TOO_LITTLE
    assert all(row.kv_share is None for row in rows)  # not known per tenant
    (pool,) = pools
    assert (pool.source, pool.hit_rate, pool.verdict) == ("engine", 0.4, PAYS)
    assert pool.gpu_seconds_saved == pytest.approx(40.0) and pool.kv_share == 0.6


def _report(**overrides: Any) -> dict[str, Any]:
    f = Fleet()
    h = _ticks(f, 21, waiting=0.0, running=3.0, kv=0.2, new=10)
    doctor = Doctor(f.src, DoctorSettings(1.0, 60.0, overrides), Context(), lambda: f.now)
    doctor.history = h
    return doctor.build(list(h.ticks), 20.0)


def documented_keys(table: str) -> list[str]:
    """The keys of one of docs/doctor.md's JSON key tables (``<!-- json keys: NAME -->``)."""
    text = (ROOT / "docs" / "doctor.md").read_text()
    m = re.search(rf"<!-- json keys: {table} -->\n(.*?)\n\n", text, re.S)
    assert m is not None, table
    return re.findall(r"^\| `([a-z_]+)` \|", m.group(1), re.M)


def test_docs_name_the_json_reports_keys_as_the_code_gives_them() -> None:
    """`kvgate doctor --json` prints the report as built here; its keys were documented
    nowhere (a script had to guess them from one output)."""
    report = _report()
    assert documented_keys("report") == list(report)
    finding = report["findings"][0]
    assert documented_keys("finding") == list(finding)
    assert documented_keys("evidence") == list(finding["evidence"][0])


def test_a_whole_report_is_json_without_nan_and_renders() -> None:
    report = _report()
    text = json.dumps(report, allow_nan=False)  # NaN (unknown) went out as null
    assert json.loads(text)["object"] == "doctor"
    assert report["worst"] == "ok" and {f["class"] for f in report["findings"]} == {"healthy"}
    assert report["window"]["samples"] == 20 and report["window"]["short"] is False
    assert report["thresholds"]["kv_high"] == 0.9
    assert {r["id"] for r in report["replicas"]} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    table = render_findings(report, "http://gw:8000")
    lines = table.splitlines()
    assert lines[0].startswith("kvgate doctor  http://gw:8000  window 20s")
    assert "a restart starts a new history" in lines[0]
    assert lines[1] == "worst: ok  (4 ok)"
    assert lines[3].split() == ["SEVERITY", "CLASS", "WHERE", "FINDING"]
    assert [ln.split()[2] for ln in lines[4:]] == [
        "gateway", "p", "p/10.0.0.1:8000", "p/10.0.0.2:8000"]
    cache = render_cache(report)
    assert "acme" in cache and "(all, engine)" in cache


def test_a_window_longer_than_the_history_is_clamped_and_said() -> None:
    f = Fleet()
    h = _ticks(f, 12, waiting=0.0, running=1.0, kv=0.1, new=3)
    doctor = Doctor(f.src, DoctorSettings(1.0, 60.0), Context(), lambda: f.now)
    doctor.history = h
    report = doctor.build(list(h.ticks), 3600.0)
    assert (report["window"]["requested_s"], report["window"]["asked_s"]) == (60.0, 3600.0)
    assert report["window"]["short"] is True  # and the history is younger still
    head = render_findings(report).splitlines()[0]
    assert "window 1m (at most doctor.history_s, not 1h00m)" in head
    assert "the history covers 11s" in head


def test_a_window_too_short_for_the_rules_says_which_window_would_do() -> None:
    """`?window=2s` with a 1 s tick holds 2 samples: nothing is judged, and waiting would not
    change that ("not judged yet" would), so every row names the shortest window that works."""
    f = Fleet()
    h = _ticks(f, 21, waiting=0.0, running=3.0, kv=0.2, new=10)
    doctor = Doctor(f.src, DoctorSettings(1.0, 60.0), Context(interval_s=1.0), lambda: f.now)
    doctor.history = h
    report = doctor.build(list(h.ticks), 2.0)
    rows = [x for x in report["findings"] if x["pool"] is not None]
    assert len(rows) == 3 and all(
        "window holds 2" in x["summary"] and "ask for a window of 5s or more" in x["summary"]
        and "yet" not in x["summary"] for x in rows), rows
    young = doctor.build(list(h.ticks)[:3], 20.0)  # a 20 s window, 2 ticks into the history
    assert all("not judged yet" in x["summary"] for x in young["findings"] if x["pool"])


def test_overrides_change_the_verdict_and_are_reported() -> None:
    report = _report(min_requests=1000)
    assert report["thresholds"]["min_requests"] == 1000
    idle = [f for f in report["findings"] if f["replica"]]
    assert all(f["summary"].startswith("idle") for f in idle)


def test_findings_render_evidence_and_action_for_non_healthy_rows() -> None:
    report = {
        "window": {"requested_s": 300, "covered_s": 40, "short": True, "start": "a", "end": "b"},
        "history": {"started_at": "2026-01-01T00:00:00Z", "note": "a restart starts a new one"},
        "process": {"pid": 7, "workers": 2}, "worst": "critical",
        "findings": [{
            "class": "KV-bound", "severity": "critical", "pool": "p", "replica": "r:1",
            "summary": "KV cache full", "action": "lower --max-num-seqs",
            "evidence": [{"metric": "vllm:kv_cache_usage_perc", "what": "KV usage p90",
                          "value": 0.97, "op": ">=", "threshold": 0.9, "unit": "%"},
                         {"metric": "vllm:num_requests_running", "what": "running",
                          "value": 12.0, "op": "", "threshold": None, "unit": ""}]}],
    }
    text = render_findings(report, "http://gw")
    assert "the history covers 40s: it started at 2026-01-01T00:00:00Z" in text
    assert "worker pid 7 of 2: this worker's requests, routing, CPU and history only" in text
    report["process"] = {"pid": 7, "workers": 2, "worker": 1}
    assert "worker 1 (pid 7) of 2: this worker's" in render_findings(report, "http://gw")
    assert "evidence: KV usage p90 97% (>= 90%) [vllm:kv_cache_usage_perc]" in text
    assert "running" not in text.split("evidence:")[1].split("\n")[0]  # unjudged: JSON only
    assert "action: lower --max-num-seqs" in text


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["--nope"], 2, "unrecognized arguments: --nope (see `kvgate doctor --help`)"),
    (["--window", "soon"], 2, "--window: invalid window 'soon'"),
    (["--timeout", "0"], 2, "--timeout must be positive"),
    (["--url", "gw:8000", "--admin-token", "x" * 20], 2, "expected http://HOST:PORT"),
    (["--timeout", "many"], 2, "argument --timeout: invalid float value"),
    (["--timeout", "nan"], 2, "--timeout must be positive and finite"),
    (["--timeout", "inf"], 2, "--timeout must be positive and finite"),
    (["--url", "http://[::1", "--admin-token", "x" * 20], 2, "expected http://HOST:PORT"),
])
def test_cli_usage_errors_are_one_line(argv: list[str], code: int, message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == code
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kvgate doctor: ")
    assert message in err


def test_cli_without_a_token(monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVGATE_ADMIN_TOKEN", raising=False)
    assert cli.main([]) == 2
    assert "no admin token" in capsys.readouterr().err


def test_cli_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "--window" in capsys.readouterr().out


def test_nan_free_helpers() -> None:
    assert math.isnan(ReplicaStats("r", "p").hit_rate)
    assert math.isnan(ReplicaStats("r", "p").time_per_request)
