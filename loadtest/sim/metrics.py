"""vLLM's Prometheus metrics for one simulated replica (V1 names, or the deprecated ones).

Counters and gauges are read from the engine at scrape time; latency histograms are observed
from engine outputs in SIMULATED seconds (what the modelled GPU would report, independent of
``--time-scale``). Bucket bounds are vLLM's defaults (`vllm/v1/metrics/buckets.py`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from loadtest.sim.engine import Engine
from loadtest.sim.runner import Track
from loadtest.sim.spec import FINISH_REASONS, EngineConfig, RequestOutput

__all__ = ["CONTENT_TYPE", "Histogram", "SimMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)  # vLLM's 1-2-5 buckets up to max_model_len
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
    """Histograms fed by the runners, plus a collector that renders everything on scrape.

    One ``engine`` label value per data-parallel engine (``"0".."N-1"``), as vLLM's
    `PrometheusStatLogger` (vllm/v1/metrics/loggers.py). With ``log_stats=False``
    (``--disable-log-stats``) no ``vllm:*`` series is exported at all, only the process ones.
    """

    def __init__(self, engines: Sequence[Engine], model: str, legacy: bool = False,
                 log_stats: bool = True, sleep_level: Callable[[], int] = lambda: 0,
                 lora: Callable[[], tuple[int, list[str]]] | None = None) -> None:
        self.engines = list(engines)
        self.model = model
        self.legacy = legacy
        self.log_stats = log_stats
        self.sleep_level = sleep_level  # 0 awake, 1 or 2: vLLM's sleep mode at that level
        self.lora = lora  # with LoRA enabled: (--max-loras, the adapters of requests in flight)
        # a counter's `_created` sample, as prometheus_client exports it outside multiprocess
        # mode (vLLM's default: one API server)
        self.created = time.time()
        n = len(self.engines)
        self.ttft = [Histogram(TTFT_BUCKETS) for _ in range(n)]
        self.itl = [Histogram(ITL_BUCKETS) for _ in range(n)]
        self.e2e = [Histogram(E2E_BUCKETS) for _ in range(n)]
        # request phases (vLLM 0.34: queue = WAITING, prefill = scheduled -> first token) and
        # the prompt tokens each request computed (not served from the prefix cache)
        self.queue = [Histogram(E2E_BUCKETS) for _ in range(n)]
        self.prefill = [Histogram(E2E_BUCKETS) for _ in range(n)]
        self.computed = [Histogram(TOKEN_BUCKETS) for _ in range(n)]
        self.admission_rejections = 0
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)
        ProcessCollector(registry=self._registry)
        PlatformCollector(registry=self._registry)

    def observer(self, index: int) -> Callable[[RequestOutput, Track], None]:
        """The runner hook of engine ``index``."""
        ttft, itl, e2e = self.ttft[index], self.itl[index], self.e2e[index]
        queue, prefill, computed = self.queue[index], self.prefill[index], self.computed[index]

        def observe(out: RequestOutput, track: Track) -> None:
            if out.first_token_time is not None:
                ttft.observe(out.first_token_time - track.arrival)
                scheduled = out.scheduled_time
                if scheduled is not None:
                    queue.observe(max(0.0, scheduled - track.arrival))
                    prefill.observe(out.first_token_time - scheduled)
                    computed.observe(out.prompt_tokens - out.cached_tokens)
                gaps = out.new_tokens - 1
                if gaps > 0 and out.time > out.first_token_time:
                    itl.observe((out.time - out.first_token_time) / gaps, gaps)
            elif out.new_tokens > 0 and track.last_time is not None:
                itl.observe((out.time - track.last_time) / out.new_tokens, out.new_tokens)
            if out.finish_reason is not None and out.finish_reason != "abort":
                e2e.observe(out.time - track.arrival)

        return observe

    def render(self) -> bytes:
        return generate_latest(self._registry)

    # prometheus_client collector protocol
    def collect(self) -> Iterator[Metric]:
        if not self.log_stats:
            return
        kv_name = "vllm:gpu_cache_usage_perc" if self.legacy else "vllm:kv_cache_usage_perc"
        pc = "vllm:gpu_prefix_cache_" if self.legacy else "vllm:prefix_cache_"
        itl_name = ("vllm:time_per_output_token_seconds" if self.legacy
                    else "vllm:inter_token_latency_seconds")
        engines = self.engines
        yield self._per_engine(GaugeMetricFamily, "vllm:num_requests_running",
                               "Number of requests in model execution batches.",
                               [e.num_running for e in engines])
        yield self._per_engine(GaugeMetricFamily, "vllm:num_requests_waiting",
                               "Number of requests waiting to be processed.",
                               [e.num_waiting for e in engines])
        if not self.legacy:  # 0.34's, sharing the name's prefix with the gauge above
            yield self._waiting_by_reason()
            yield self._sleep_state()
        yield self._per_engine(GaugeMetricFamily, kv_name,
                               "KV-cache usage. 1 means 100 percent usage.",
                               [e.kv_usage for e in engines])
        stats = [e.stats for e in engines]
        yield self._per_engine(CounterMetricFamily, pc + "queries", "Prefix cache queries, in "
                               "terms of number of queried tokens.",
                               [s.prefix_cache_queries for s in stats])
        yield self._per_engine(CounterMetricFamily, pc + "hits", "Prefix cache hits, in terms "
                               "of number of cached tokens.", [s.prefix_cache_hits for s in stats])
        yield self._per_engine(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number "
                               "of preemption from the engine.", [s.preemptions for s in stats])
        yield self._per_engine(CounterMetricFamily, "vllm:prompt_tokens", "Number of prefill "
                               "tokens processed.", [s.prompt_tokens for s in stats])
        yield self._per_engine(CounterMetricFamily, "vllm:generation_tokens", "Number of "
                               "generation tokens processed.", [s.generation_tokens for s in stats])
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                      "requests.", labels=[*LABELS, "finished_reason"])
        for i, s in enumerate(stats):
            for reason in FINISH_REASONS:
                success.add_metric([self.model, str(i), reason], s.finished[reason],
                                   created=self.created)
        yield success
        rejected = CounterMetricFamily("vllm:admission_rejections", "Requests rejected by the "
                                       "admission limits.", labels=["model_name", "reason"])
        rejected.add_metric([self.model, "max_num_queued_reqs"], self.admission_rejections,
                            created=self.created)
        yield rejected
        yield self._hists("vllm:time_to_first_token_seconds", "Histogram of time to first token "
                          "in seconds.", self.ttft)
        yield self._hists("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency "
                          "in seconds.", self.e2e)
        yield self._hists(itl_name, "Histogram of inter-token latency in seconds.", self.itl)
        yield self._hists("vllm:request_queue_time_seconds", "Histogram of time spent in "
                          "WAITING phase for request.", self.queue)
        yield self._hists("vllm:request_prefill_time_seconds", "Histogram of time spent in "
                          "PREFILL phase for request.", self.prefill)
        yield self._hists("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV "
                          "tokens computed during prefill (excluding cached tokens).",
                          self.computed)
        yield self._cache_config_info()
        if self.lora is not None:
            yield self._lora_info(*self.lora())

    def _per_engine(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                    doc: str, values: Sequence[float]) -> Metric:
        family = kind(name, doc, labels=LABELS)
        for i, v in enumerate(values):
            if isinstance(family, CounterMetricFamily):
                family.add_metric([self.model, str(i)], v, created=self.created)
            else:
                family.add_metric([self.model, str(i)], v)
        return family

    def _waiting_by_reason(self) -> Metric:
        """0.34: the waiting requests by why they wait; the simulated scheduler defers none
        (its waiting requests all wait for capacity), so ``deferred`` is 0."""
        family = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Number of requests "
                                   "waiting, by reason.", labels=[*LABELS, "reason"])
        for i, engine in enumerate(self.engines):
            family.add_metric([self.model, str(i), "capacity"], engine.num_waiting)
            family.add_metric([self.model, str(i), "deferred"], 0.0)
        return family

    def _lora_info(self, max_loras: int, running: list[str]) -> Metric:
        """vLLM's LoRA gauge (only with LoRA enabled): its value the time of the last update,
        the adapters of running and waiting requests comma-joined in labels. The simulator
        names every adapter with a request in flight as running, none as waiting."""
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "running_lora_adapters",
                                           "waiting_lora_adapters"])
        family.add_metric([str(max_loras), ",".join(running), ""], time.time())
        return family

    def _sleep_state(self) -> Metric:
        """vLLM's sleep mode, per engine: ``awake`` 1 while awake, else 0 with
        ``weights_offloaded`` (level 1) or ``discard_all`` (level 2) 1."""
        level = self.sleep_level()
        family = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state; awake = 0 "
                                   "means engine is sleeping; awake = 1 means engine is awake; "
                                   "weights_offloaded = 1 means sleep level 1; discard_all = 1 "
                                   "means sleep level 2.", labels=[*LABELS, "sleep_state"])
        for i in range(len(self.engines)):
            for state, on in (("awake", level == 0), ("weights_offloaded", level == 1),
                              ("discard_all", level == 2)):
                family.add_metric([self.model, str(i), state], float(on))
        return family

    def _hists(self, name: str, doc: str, hists: Sequence[Histogram]) -> Metric:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        for i, h in enumerate(hists):
            family.add_metric([self.model, str(i)], h.buckets(), h.sum)
        return family

    def _cache_config_info(self) -> Metric:
        """One series per engine; ``num_gpu_blocks`` is the TOTAL over the data-parallel engines
        (v1/engine/core_client.py sums the engines' counts into the shared CacheConfig before the
        loggers export it), ``kv_cache_size_tokens`` this engine's own KV capacity in tokens."""
        cfg = self.engines[0].config
        total_blocks = sum(e.config.num_gpu_blocks for e in self.engines)
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                   "CacheConfig", labels=list(_info(cfg, 0, 0)))
        for i, engine in enumerate(self.engines):
            info = _info(cfg, i, total_blocks)
            info["kv_cache_size_tokens"] = str(engine.config.num_gpu_blocks
                                               * engine.config.block_size)
            family.add_metric(list(info.values()), 1.0)
        return family


LABELS = ["model_name", "engine"]


def _info(cfg: EngineConfig, index: int, total_blocks: int) -> dict[str, str]:
    return {
        "block_size": str(cfg.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "engine": str(index),
        "gpu_memory_utilization": "0.9",
        "kv_cache_size_tokens": "",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(total_blocks),
        "prefix_caching_hash_algo": "sha256",  # 0.34's default
    }
