"""One vLLM ``/metrics`` page read into a `Sample` (pure: no I/O; `gateway.scrape` polls).

`parse_vllm_metrics` turns one page into a `Sample`, reading the current vLLM names and, where
a current name is absent, the deprecated one (``gpu_cache_usage_perc`` before 0.9.2,
``gpu_prefix_cache_*`` before 0.9, ``time_per_output_token_seconds`` for the inter-token
histogram; names from vLLM's ``v1/metrics/loggers.py``). Of the TTFT, inter-token and
queue-time histograms only ``_sum`` and ``_count`` are read (`kvgate doctor`'s means). Counts and
counters are summed over the ``engine`` label (one series per data-parallel rank); KV usage, a
fraction, takes the fullest engine; ``vllm:engine_sleep_state`` says whether an engine is asleep
(vLLM's sleep mode). Capacity comes from ``vllm:cache_config_info``: vLLM exports
one series per engine and each already carries the total over the data-parallel engines
(v1/metrics/loggers.py, v1/engine/core_client.py), so ONE series is read (``block_size`` x
``num_gpu_blocks``), never their sum; where the series carry vLLM 0.34's per-engine
``kv_cache_size_tokens`` label (right for hybrid models too, config/cache.py) it wins, summed
over the engines. A page without any ``vllm:`` series (``--disable-log-stats``) is not a
sample: `parse_vllm_metrics` raises `NoLoadData`, the scrape counts as failed and the
replica's last sample ages out (the router then relies on its own accounting).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from routing.learning import EngineCounters

__all__ = ["NoLoadData", "Sample", "parse_vllm_metrics"]

# sample name -> Sample field; current names first (they win when both are present)
_SUMMED: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "prefix_cache_queries": (
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
    ),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "preemptions": ("vllm:num_preemptions_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    # request phases (vLLM >= 0.7): what the router learns its TTFT model from
    "prefill_seconds": ("vllm:request_prefill_time_seconds_sum",),
    "prefill_requests": ("vllm:request_prefill_time_seconds_count",),
    "prefill_computed_tokens": ("vllm:request_prefill_kv_computed_tokens_sum",),
    # engine-side latency histograms: only their _sum and _count (means over a window, for
    # `kvgate doctor`); seconds of the engine's own clock
    "ttft_sum": ("vllm:time_to_first_token_seconds_sum",),
    "ttft_count": ("vllm:time_to_first_token_seconds_count",),
    "itl_sum": ("vllm:inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum"),
    "itl_count": (
        "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
    "queue_time_sum": ("vllm:request_queue_time_seconds_sum",),
    "queue_time_count": ("vllm:request_queue_time_seconds_count",),
}
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_CACHE_INFO = "vllm:cache_config_info"
# vLLM's sleep mode, per engine: {sleep_state="awake"} 0 while it sleeps (its scheduling paused,
# its KV cache discarded; /health still 200)
_SLEEP = "vllm:engine_sleep_state"
_WANTED_NAMES = frozenset({n for names in _SUMMED.values() for n in names}
                          | {*_KV, _CACHE_INFO, _SLEEP})
_WANTED = tuple(sorted(_WANTED_NAMES))
# one sample line of the text format: name, optional {labels}, value (a timestamp may follow)
# (labels: quoted values may hold "}" and spaces; an OpenMetrics exemplar after " # " is ignored)
_SAMPLE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]*(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?[ \t]+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True, slots=True)
class Sample:
    """One replica's state from one scrape (``None`` = the page did not say)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1, fullest engine
    prefix_cache_queries: float | None = None  # counters (tokens; blocks before vLLM 0.9)
    prefix_cache_hits: float | None = None
    preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None  # the whole replica's (one cache_config_info series)
    legacy_names: bool = False  # True when a deprecated name was read
    kv_cache_size_tokens: int | None = None  # sum of the engines' `kv_cache_size_tokens`
    prefill_seconds: float | None = None  # request_prefill_time_seconds sum and count
    prefill_requests: float | None = None
    prefill_computed_tokens: float | None = None  # request_prefill_kv_computed_tokens sum
    # counters: _sum and _count of the engine's TTFT, inter-token and queue-time histograms
    ttft_sum: float | None = None
    ttft_count: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None
    queue_time_sum: float | None = None
    queue_time_count: float | None = None
    # an engine of the replica reports itself asleep (`vllm:engine_sleep_state`, awake 0);
    # None: the page has no such gauge (vLLM before it)
    asleep: bool | None = None

    def engine_counters(self) -> EngineCounters | None:
        """The cumulative prefill counters the router learns from (None: not exported).
        Without the computed-tokens histogram (older vLLM), prompt tokens minus prefix-cache
        hits stand in for it."""
        if self.prefill_seconds is None or self.prefill_requests is None:
            return None
        computed = self.prefill_computed_tokens
        if computed is None and self.prompt_tokens is not None:
            computed = self.prompt_tokens - (self.prefix_cache_hits or 0.0)
        if computed is None:
            return None
        return EngineCounters(self.prefill_seconds, self.prefill_requests, computed,
                              self.waiting)

    @property
    def cache_capacity_tokens(self) -> int | None:
        if self.kv_cache_size_tokens is not None:
            return self.kv_cache_size_tokens
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


class NoLoadData(ValueError):
    """The page has no ``vllm:`` series at all (vLLM started with ``--disable-log-stats``)."""


def _samples(text: str) -> Iterator[tuple[str, str, float]]:
    """(name, raw labels, value) of the page's lines that `parse_vllm_metrics` reads. A vLLM
    page is mostly histogram buckets; the few series read are a handful of lines, picked by
    their prefix before anything is parsed (the text format: prometheus.io/docs/instrumenting/
    exposition_formats). A line that does not parse is a bad page (ValueError)."""
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a sample line: {line[:80]!r}")
        if m.group(1) in _WANTED_NAMES:
            name, value = m.group(1), float(m.group(3))
            # NaN, +-Inf or a negative count/fraction is no reading (every series read here is a
            # count, a counter, a histogram's _sum/_count or a fraction): the series is skipped,
            # as if the page did not export it, instead of poisoning the sums the router reads;
            # so is a KV usage above 1 (a fraction, whatever "perc" says: an exporter's per
            # cent, 75, kept the replica full by flow control's KV knee, its pool saturated)
            if math.isfinite(value) and value >= 0.0 and (value <= 1.0 or name not in _KV):
                yield name, m.group(2) or "", value


def _labels(raw: str) -> dict[str, str]:
    return {k: re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], v)
            for k, v in _LABEL.findall(raw)}


def _int_label(value: str | None) -> int | None:
    """A size label (block size, blocks, tokens): None unless a number of at least 1 (a
    negative one made a negative capacity: the router's index kept one block of the
    replica's prefixes)."""
    try:
        n = int(float(value)) if value not in (None, "", "None") else 0
    except (ValueError, OverflowError):  # not a number, NaN; "inf" (an OverflowError)
        return None
    return n if n >= 1 else None


def _collect(text: str) -> tuple[dict[str, float], dict[str, float], list[dict[str, str]]]:
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    infos: list[dict[str, str]] = []
    for name, labels, value in _samples(text):
        if name == _CACHE_INFO:
            infos.append(_labels(labels))
        elif name == _SLEEP:
            # one engine asleep is enough: the replica's DP balancer may send it a request,
            # which would wait there until it wakes (the lowest "awake" reading is kept)
            if _labels(labels).get("sleep_state") == "awake":
                maxima[_SLEEP] = min(maxima.get(_SLEEP, 1.0), value)
        elif name in _KV:
            maxima[name] = max(maxima.get(name, 0.0), value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    # a sum past the largest float (engines' absurd counts added up) is no reading either
    return {k: v for k, v in sums.items() if math.isfinite(v)}, maxima, infos


def _capacity(infos: list[dict[str, str]]) -> tuple[int | None, int | None, int | None]:
    """(block_size, num_gpu_blocks, kv_cache_size_tokens) from the cache_config_info series."""
    if not infos:
        return None, None, None
    one = min(infos, key=lambda labels: labels.get("engine", ""))  # engine "0" (or the only)
    per_engine = {labels.get("engine", ""): _int_label(labels.get("kv_cache_size_tokens"))
                  for labels in infos}
    sizes = [n for n in per_engine.values() if n is not None]
    tokens = sum(sizes) if sizes and len(sizes) == len(per_engine) else None
    return _int_label(one.get("block_size")), _int_label(one.get("num_gpu_blocks")), tokens


def parse_vllm_metrics(text: str) -> Sample:
    """Parse one vLLM ``/metrics`` page (current or deprecated names). Raises ValueError
    (`NoLoadData` when the page holds no ``vllm:`` series)."""
    if "vllm:" not in text:
        raise NoLoadData("no vllm:* series (--disable-log-stats?)")
    sums, maxima, infos = _collect(text)
    fields: dict[str, float | None] = {}
    legacy = False
    for field, names in _SUMMED.items():
        found = next((n for n in names if n in sums), None)
        fields[field] = sums[found] if found else None
        legacy |= found is not None and found != names[0]
    kv_name = next((n for n in _KV if n in maxima), None)
    legacy |= kv_name == _KV[1]
    block_size, num_gpu_blocks, kv_tokens = _capacity(infos)
    awake = maxima.get(_SLEEP)
    return Sample(
        kv_usage=maxima[kv_name] if kv_name else None,
        asleep=None if awake is None else awake < 0.5,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        kv_cache_size_tokens=kv_tokens,
        legacy_names=legacy,
        **fields,
    )
