"""`kvgate sim` defaults and switches that follow vLLM 0.34: block size, usage details, priority,
keep-alive comments, data-parallel metrics, --disable-log-stats, the endpoint-load-metrics
header."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
MSG: list[Any] = [{"role": "user", "content": "hello " * 100}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics").text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def test_defaults_block_size_64_no_cached_tokens_priority_ignored(
        sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50")
    client = _client(url)
    for _ in range(2):
        resp = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                              extra_body={"priority": 5})  # fcfs: ignored
        assert resp.usage is not None and resp.usage.prompt_tokens_details is None
    raw = httpx.post(f"{url}/v1/chat/completions",
                     json={"model": MODEL, "messages": MSG, "max_tokens": 1}).json()
    assert raw["usage"]["prompt_tokens_details"] is None
    info = [ls for n, ls, _ in _samples(url) if n == "vllm:cache_config_info"]
    assert [ls["block_size"] for ls in info] == ["64"]
    stats = httpx.get(f"{url}/sim/stats").json()
    assert stats["cached_tokens"] > 0 and stats["cached_tokens"] % 64 == 0  # hits, 64 per block


def test_chat_stream_role_chunk_comes_with_the_first_token_and_keep_alive(
        sim_factory: SimFactory) -> None:
    # 50x slower than real time: the prefill takes long enough for a few keep-alive comments
    _, url = sim_factory("--time-scale", "0.02", "--sse-keep-alive-interval", "0.05")
    body = {"model": MODEL, "messages": MSG, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data >= 1 and set(lines[:first_data]) == {": keep-alive"}
    role = json.loads(lines[first_data][6:])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert lines[-1] == "data: [DONE]"


def test_no_keep_alive_by_default(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "0.02")
    body = {"model": MODEL, "messages": MSG, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert not any(line.startswith(":") for line in lines)


def test_data_parallel_engines_and_cache_config_info(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "1", "--data-parallel-size", "2",
                         "--num-gpu-blocks", "1000", "--max-model-len", "8192")
    body = {"model": MODEL, "prompt": "x " * 50, "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as one:
        lines = one.iter_lines()
        next(lines)
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": "y " * 50}
                          ) as two:
            lines2 = two.iter_lines()
            next(lines2)
            engines = httpx.get(f"{url}/sim/stats").json()["engines"]
            running = {ls["engine"]: v for n, ls, v in _samples(url)
                       if n == "vllm:num_requests_running"}
    assert [e["running"] for e in engines] == [1, 1]  # the DP balancer spread them
    assert running == {"0": 1.0, "1": 1.0}
    info = {ls["engine"]: ls for n, ls, _ in _samples(url) if n == "vllm:cache_config_info"}
    assert set(info) == {"0", "1"}
    for labels in info.values():  # each series carries the total, as vLLM's
        assert labels["num_gpu_blocks"] == "2000"
        assert labels["kv_cache_size_tokens"] == str(1000 * 64)  # per engine


def test_disable_log_stats_removes_every_vllm_series(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--disable-log-stats", "--time-scale", "50")
    _client(url).completions.create(model=MODEL, prompt="x", max_tokens=1)
    names = {n for n, _, _ in _samples(url)}
    assert names and not any(n.startswith("vllm:") for n in names)


def test_endpoint_load_metrics_header(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50")
    client = _client(url)
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MSG, max_tokens=1,
        extra_headers={"endpoint-load-metrics-format": "text"})
    header = chat.headers["endpoint-load-metrics"]
    assert header.startswith("TEXT ")
    pairs = dict(p.split("=") for p in header[5:].split(", "))
    assert set(pairs) == {"named_metrics.num_requests_waiting",
                          "named_metrics.kv_cache_usage_perc"}
    assert all(0.0 <= float(v) <= 1.0 for v in pairs.values())  # one request, idle now
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="x", max_tokens=1,
        extra_headers={"endpoint-load-metrics-format": "json"})
    kind, _, doc = raw.headers["endpoint-load-metrics"].partition(" ")
    assert kind == "JSON"
    assert set(json.loads(doc)["named_metrics"]) == {"num_requests_waiting",
                                                     "kv_cache_usage_perc"}
    plain = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSG,
                                                             max_tokens=1)
    assert "endpoint-load-metrics" not in plain.headers
    body = {"model": MODEL, "messages": MSG, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                      headers={"endpoint-load-metrics-format": "text"}) as r:
        assert "endpoint-load-metrics" not in r.headers  # streams never carry it


def test_a_hung_engine_still_sends_keep_alive_comments(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50", "--hang-after-tokens", "1",
                         "--sse-keep-alive-interval", "0.05")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    seen: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line:
                seen.append(line)
            if seen.count(": keep-alive") >= 3 and seen[0].startswith("data: "):
                break
    data = [json.loads(line[6:]) for line in seen if line.startswith("data: ")]
    assert len("".join(c["choices"][0]["text"] for c in data)) == 4  # one token, then nothing
    assert "data: [DONE]" not in seen


def test_slow_health_ping_and_load_tracking(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "1")
    assert httpx.get(f"{url}/ping").status_code == 200
    assert httpx.post(f"{url}/ping").status_code == 200
    httpx.post(f"{url}/sim/faults", json={"health_latency_ms": 3000}).raise_for_status()
    try:
        httpx.get(f"{url}/health", timeout=0.2)
        raise AssertionError("/health answered before its latency")
    except httpx.ReadTimeout:
        pass
    httpx.post(f"{url}/sim/faults", json={"health_latency_ms": 0, "dead": True})
    assert httpx.get(f"{url}/ping").status_code == 503  # /ping is /health
    httpx.post(f"{url}/sim/faults", json={"dead": False})
    body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        assert httpx.get(f"{url}/load").json() == {"server_load": 0}  # not tracked by default


def test_load_tracking_counts_in_flight(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "1", "--enable-server-load-tracking")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        assert httpx.get(f"{url}/load").json() == {"server_load": 1}


def test_return_token_ids_puts_prompt_ids_after_usage(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50")
    raw = httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": MSG, "max_tokens": 3, "return_token_ids": True})
    body = raw.json()
    keys = list(body)
    assert keys.index("prompt_token_ids") > keys.index("usage")
    assert len(body["prompt_token_ids"]) == body["usage"]["prompt_tokens"]
    assert len(body["choices"][0]["token_ids"]) == 3
    # the usage object is far from the end of the body (a gateway must not look only there)
    assert len(raw.content) - raw.content.index(b'"usage"') > 1024
