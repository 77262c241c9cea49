"""vLLM's Prometheus metrics for one simulated replica (V1 names, or the deprecated ones).

Counters and gauges are read from the engine at scrape time; latency histograms are observed
from engine outputs in SIMULATED seconds (what the modelled GPU would report, independent of
``--time-scale``). Bucket bounds are vLLM's defaults (`vllm/v1/metrics/buckets.py`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from loadtest.sim.engine import Engine
from loadtest.sim.runner import Track
from loadtest.sim.spec import FINISH_REASONS, RequestOutput

__all__ = ["CONTENT_TYPE", "Histogram", "SimMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Cumulative-on-export bucket counts."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            acc += count
            out.append((bound, float(acc)))
        return out


class SimMetrics:
    """Histograms fed by the runner, plus a collector that renders everything on scrape."""

    def __init__(self, engine: Engine, model: str, legacy: bool = False) -> None:
        self.engine = engine
        self.model = model
        self.legacy = legacy
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.admission_rejections = 0
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    def observe(self, out: RequestOutput, track: Track) -> None:
        """Runner hook: one output of one request."""
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - track.arrival)
            gaps = out.new_tokens - 1
            if gaps > 0 and out.time > out.first_token_time:
                self.itl.observe((out.time - out.first_token_time) / gaps, gaps)
        elif out.new_tokens > 0 and track.last_time is not None:
            self.itl.observe((out.time - track.last_time) / out.new_tokens, out.new_tokens)
        if out.finish_reason is not None and out.finish_reason != "abort":
            self.e2e.observe(out.time - track.arrival)

    def render(self) -> bytes:
        return generate_latest(self._registry)

    # prometheus_client collector protocol
    def collect(self) -> Iterator[Metric]:
        labels, values = ["model_name", "engine"], [self.model, "0"]
        e, s = self.engine, self.engine.stats
        kv_name = "vllm:gpu_cache_usage_perc" if self.legacy else "vllm:kv_cache_usage_perc"
        pc = "vllm:gpu_prefix_cache_" if self.legacy else "vllm:prefix_cache_"
        itl_name = ("vllm:time_per_output_token_seconds" if self.legacy
                    else "vllm:inter_token_latency_seconds")
        yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                     labels, values, e.num_running)
        yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     labels, values, e.num_waiting)
        yield _gauge(kv_name, "KV-cache usage. 1 means 100 percent usage.", labels, values,
                     e.kv_usage)
        yield _counter(pc + "queries", "Prefix cache queries, in terms of number of queried "
                       "tokens.", labels, values, s.prefix_cache_queries)
        yield _counter(pc + "hits", "Prefix cache hits, in terms of number of cached tokens.",
                       labels, values, s.prefix_cache_hits)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the "
                       "engine.", labels, values, s.preemptions)
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                       values, s.prompt_tokens)
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.",
                       labels, values, s.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                      "requests.", labels=[*labels, "finished_reason"])
        for reason in FINISH_REASONS:
            success.add_metric([*values, reason], s.finished[reason])
        yield success
        rejected = CounterMetricFamily("vllm:admission_rejections", "Requests rejected by the "
                                       "admission limits.", labels=["model_name", "reason"])
        rejected.add_metric([self.model, "max_num_queued_reqs"], self.admission_rejections)
        yield rejected
        yield _hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                    "seconds.", labels, values, self.ttft)
        yield _hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in "
                    "seconds.", labels, values, self.e2e)
        yield _hist(itl_name, "Histogram of inter-token latency in seconds.", labels, values,
                    self.itl)
        yield self._cache_config_info()

    def _cache_config_info(self) -> Metric:
        cfg = self.engine.config
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "engine": "",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "prefix_caching_hash_algo": "xxhash",
        }
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                   "CacheConfig", labels=list(info))
        family.add_metric(list(info.values()), 1.0)
        return family


def _gauge(name: str, doc: str, labels: list[str], values: list[str], v: float) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=labels)
    family.add_metric(values, v)
    return family


def _counter(name: str, doc: str, labels: list[str], values: list[str], v: float) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    family.add_metric(values, v)
    return family


def _hist(name: str, doc: str, labels: list[str], values: list[str], h: Histogram) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=labels)
    family.add_metric(values, h.buckets(), h.sum)
    return family
