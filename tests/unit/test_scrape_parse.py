"""`parse_vllm_metrics` on text fixtures of both vLLM metric dialects."""

from __future__ import annotations

import pytest

from gateway.scrape import NoLoadData, Sample, parse_vllm_metrics
from routing.learning import EngineCounters

CURRENT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen-fp8"} 12.0
vllm:num_requests_running{engine="1",model_name="qwen-fp8"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen-fp8"} 3.0
vllm:num_requests_waiting{engine="1",model_name="qwen-fp8"} 1.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="qwen-fp8",reason="capacity"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen-fp8"} 0.4375
vllm:kv_cache_usage_perc{engine="1",model_name="qwen-fp8"} 0.75
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen-fp8"} 1.2288e+06
vllm:prefix_cache_queries_total{engine="1",model_name="qwen-fp8"} 1000.0
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="qwen-fp8"} 1.7e+09
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="qwen-fp8"} 786432.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="qwen-fp8"} 7.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="qwen-fp8"} 1204.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="qwen-fp8"} 1602.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="qwen-fp8"} 1602.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="qwen-fp8"} 141.7
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="",\
num_gpu_blocks="28000",prefix_caching_hash_algo="sha256"} 1.0
"""

LEGACY = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 5.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.91
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="llama"} 100.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="llama"} 40.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="None"} 1.0
"""

BOTH = (
    CURRENT
    + """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="qwen-fp8"} 0.99
"""
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            CURRENT,
            Sample(
                running=15.0,
                waiting=4.0,
                kv_usage=0.75,
                prefix_cache_queries=1_229_800.0,
                prefix_cache_hits=786_432.0,
                preemptions=7.0,
                block_size=16,
                num_gpu_blocks=28_000,
                legacy_names=False,
                ttft_sum=141.7,
                ttft_count=1602.0,
            ),
        ),
        (
            LEGACY,
            Sample(
                running=2.0,
                waiting=5.0,
                kv_usage=0.91,
                prefix_cache_queries=100.0,
                prefix_cache_hits=40.0,
                block_size=32,
                num_gpu_blocks=None,
                legacy_names=True,
            ),
        ),
    ],
)
def test_parse(text: str, expected: Sample) -> None:
    assert parse_vllm_metrics(text) == expected


def test_latency_histograms_sum_and_count_current_and_deprecated_names() -> None:
    page = """\
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 4.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 10.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 1.5
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 30.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 2.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 8.0
"""
    s = parse_vllm_metrics(page)
    assert (s.itl_sum, s.itl_count) == (2.0, 40.0)  # summed over the engines
    assert (s.queue_time_sum, s.queue_time_count) == (2.0, 8.0)
    assert s.ttft_sum is None and not s.legacy_names
    old = parse_vllm_metrics(
        'vllm:time_per_output_token_seconds_sum{model_name="m"} 3.0\n'
        'vllm:time_per_output_token_seconds_count{model_name="m"} 60.0\n')
    assert (old.itl_sum, old.itl_count, old.legacy_names) == (3.0, 60.0, True)


def test_current_name_wins_over_deprecated() -> None:
    s = parse_vllm_metrics(BOTH)
    assert s.kv_usage == 0.75
    assert not s.legacy_names


@pytest.mark.parametrize(
    ("block_size", "blocks", "tokens"),
    [("16", "28000", 448_000), ("16", "None", None), ("16", "inf", None), ("16", "nan", None),
     ("1e999", "100", None), ("-16", "28000", None), ("16", "-28000", None)],
)
def test_capacity(block_size: str, blocks: str, tokens: int | None) -> None:
    text = f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}"}} 1.0\n'
    assert parse_vllm_metrics(text).cache_capacity_tokens == tokens


def test_garbage_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics('vllm:num_requests_running{engine="0" 12\n')


# `--disable-log-stats` removes every vllm:* series: no load data, not a sample of Nones
@pytest.mark.parametrize(
    "text",
    ["", "# only a comment\nsome_other_metric 1\n",
     'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 3.0\n'
     'process_resident_memory_bytes 1.2e+09\n'],
)
def test_a_page_without_vllm_series_is_no_load_data(text: str) -> None:
    with pytest.raises(NoLoadData):
        parse_vllm_metrics(text)


# vLLM exports one cache_config_info per engine, each with the total over the data-parallel
# engines (v1/metrics/loggers.py, v1/engine/core_client.py): 2 engines, 2,000 blocks in all
DP2 = """\
vllm:cache_config_info{block_size="16",engine="0",model_name="m",num_gpu_blocks="2000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",model_name="m",num_gpu_blocks="2000"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
"""


def test_data_parallel_capacity_is_read_from_one_series() -> None:
    s = parse_vllm_metrics(DP2)
    assert s.cache_capacity_tokens == 32_000  # not 64,000
    assert s.running == 3.0  # request counts still add up over the engines


def test_per_engine_kv_cache_size_tokens_wins() -> None:
    # a hybrid model: num_gpu_blocks x block_size is wrong (config/cache.py); the per-engine
    # label is right, and the replica holds the engines' sum
    text = DP2.replace('num_gpu_blocks="2000"}',
                       'kv_cache_size_tokens="12000",num_gpu_blocks="2000"}')
    assert parse_vllm_metrics(text).cache_capacity_tokens == 24_000
    # one engine's label below 1 is no reading: the blocks say it
    assert parse_vllm_metrics(text.replace('"12000",', '"-12000",', 1)).cache_capacity_tokens \
        == 32_000


PHASES = """\
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 90000.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 10000.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 30.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 30.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 6.5
vllm:request_prefill_time_seconds_count{engine="1",model_name="m"} 10.0
vllm:request_prefill_time_seconds_sum{engine="1",model_name="m"} 1.5
"""
COMPUTED = """\
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 30.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 55000.0
vllm:request_prefill_kv_computed_tokens_sum{engine="1",model_name="m"} 5000.0
"""
HITS = 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30000.0\n'


@pytest.mark.parametrize(
    ("text", "counters"),
    [
        # the prefill histograms, summed over the engines: what the TTFT model learns from
        (PHASES + COMPUTED, EngineCounters(8.0, 40.0, 60_000.0)),
        # a vLLM without the computed-tokens histogram: prompt tokens minus prefix-cache hits
        (PHASES + HITS, EngineCounters(8.0, 40.0, 70_000.0)),
        (CURRENT, None),  # no prefill-time histogram: nothing to learn from
    ],
)
def test_engine_counters(text: str, counters: EngineCounters | None) -> None:
    assert parse_vllm_metrics(text).engine_counters() == counters


def test_text_format_details() -> None:
    # escaped label values, a timestamp after the value, a series whose name only starts
    # with a name that is read, and a label value holding a brace and a space
    text = (
        'vllm:cache_config_info{block_size="16",model_name="a \\"quoted\\" {name}",'
        'num_gpu_blocks="100"} 1.0\n'
        'vllm:num_requests_running{engine="0"} 2.0 1700000000000\n'
        'vllm:num_requests_running_extra{engine="0"} 50.0\n'
        "vllm:num_requests_waiting 4\n"
    )
    s = parse_vllm_metrics(text)
    assert (s.running, s.waiting, s.cache_capacity_tokens) == (2.0, 4.0, 1600)


def test_a_value_that_is_not_a_number_is_a_bad_page() -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics('vllm:num_requests_running{engine="0"} twelve\n')


def test_an_openmetrics_exemplar_and_a_space_before_the_labels() -> None:
    text = ('vllm:num_requests_running {engine="0"} 3.0\n'
            'vllm:prompt_tokens_total{engine="0",x="a } # {b"} 10 # {trace_id="abc"} 1.0\n')
    s = parse_vllm_metrics(text)
    assert (s.running, s.prompt_tokens) == (3.0, 10.0)


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf", "-3"])
def test_a_non_finite_or_negative_reading_is_skipped_not_summed(bad: str) -> None:
    text = (f'vllm:num_requests_waiting{{engine="0"}} {bad}\n'
            'vllm:num_requests_waiting{engine="1"} 2\n'
            f"vllm:num_requests_running {bad}\n"
            f"vllm:kv_cache_usage_perc {bad}\n"
            "vllm:prompt_tokens_total 7\n")
    s = parse_vllm_metrics(text)
    assert (s.waiting, s.running, s.kv_usage, s.prompt_tokens) == (2.0, None, None, 7.0)


def test_a_sum_past_the_largest_float_is_no_reading() -> None:
    """Two engines' counts each finite but adding up to infinity: no reading, as a NaN is (an
    infinite queue made every pick of the pool raise)."""
    s = parse_vllm_metrics('vllm:num_requests_waiting{engine="0"} 1e308\n'
                           'vllm:num_requests_waiting{engine="1"} 1e308\n'
                           'vllm:num_requests_running{engine="0"} 2\n')
    assert s.waiting is None
    assert s.running == 2.0


def test_a_kv_usage_above_one_is_no_reading() -> None:
    """KV usage is a fraction (vLLM's ``kv_cache_usage_perc`` too): 75 (per cent, scaled by an
    exporter) is skipped, an engine's in range is read."""
    s = parse_vllm_metrics('vllm:kv_cache_usage_perc{engine="0"} 75\n'
                           'vllm:kv_cache_usage_perc{engine="1"} 0.5\n'
                           "vllm:gpu_cache_usage_perc 1.5\n")
    assert s.kv_usage == 0.5
    assert parse_vllm_metrics("vllm:kv_cache_usage_perc 1\n").kv_usage == 1.0
