"""The endpoint-load-metrics header in vLLM's TEXT and JSON forms, and DP metrics rendering."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from loadtest.sim.costmodel import get_preset
from loadtest.sim.engine import Engine
from loadtest.sim.loadreport import load_report_header
from loadtest.sim.metrics import SimMetrics
from loadtest.sim.spec import EngineConfig, RequestSpec


def _engines(n: int) -> list[Engine]:
    cfg = EngineConfig(cost=get_preset("h100-8b-fp8").cost, num_gpu_blocks=100, block_size=64,
                       max_model_len=4096)
    return [Engine(cfg) for _ in range(n)]


def test_text_and_json_forms() -> None:
    engines = _engines(1)
    engines[0].add_request(RequestSpec("r", (), prompt_tokens=10, max_tokens=5), 0.0)
    text = load_report_header("TEXT", engines)
    assert text == [(b"endpoint-load-metrics", b"TEXT named_metrics.num_requests_waiting=1.0, "
                     b"named_metrics.kv_cache_usage_perc=0.0")]
    (name, value), = load_report_header("json", engines)
    kind, _, doc = value.decode().partition(" ")
    assert (name, kind) == (b"endpoint-load-metrics", "JSON")
    assert json.loads(doc) == {"named_metrics": {"num_requests_waiting": 1.0,
                                                 "kv_cache_usage_perc": 0.0}}
    assert load_report_header("bin", engines) == []
    assert load_report_header("text", engines, log_stats=False) == [
        (b"endpoint-load-metrics", b"TEXT ")]


def test_metrics_one_series_per_engine_and_total_blocks() -> None:
    text = SimMetrics(_engines(3), "m").render().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    waiting = sorted(s.labels["engine"] for s in samples if s.name == "vllm:num_requests_waiting")
    assert waiting == ["0", "1", "2"]
    info = [s.labels for s in samples if s.name == "vllm:cache_config_info"]
    assert [i["engine"] for i in info] == ["0", "1", "2"]
    assert {i["num_gpu_blocks"] for i in info} == {"300"}
    assert {i["kv_cache_size_tokens"] for i in info} == {"6400"}
    off = SimMetrics(_engines(1), "m", log_stats=False).render().decode()
    assert "vllm:" not in off
