"""The ``endpoint-load-metrics`` (ORCA) response header of non-streamed chat/completions replies.

vLLM (vllm/entrypoints/serve/utils/orca_metrics.py) answers a request that carries
``endpoint-load-metrics-format: text|json`` with the named metrics it maps from its Prometheus
gauges: ``kv_cache_usage_perc`` and ``num_requests_waiting`` (no running count), one entry per
engine series, in registration order (waiting before KV usage):

    endpoint-load-metrics: TEXT named_metrics.num_requests_waiting=0.0, named_metrics.kv_cache_usage_perc=0.25
    endpoint-load-metrics: JSON {"named_metrics": {"num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.25}}

In JSON a later engine's value replaces an earlier one (a dict). Another format: no header.
With --disable-log-stats there are no gauges, so the report is empty.
"""  # noqa: E501

from __future__ import annotations

import json
from collections.abc import Sequence

from loadtest.sim.engine import Engine

__all__ = ["load_report_header", "named_metrics"]


def named_metrics(engines: Sequence[Engine], log_stats: bool = True) -> list[tuple[str, float]]:
    if not log_stats:
        return []
    waiting = [("num_requests_waiting", float(e.num_waiting)) for e in engines]
    usage = [("kv_cache_usage_perc", float(e.kv_usage)) for e in engines]
    return waiting + usage


def load_report_header(fmt: str, engines: Sequence[Engine],
                       log_stats: bool = True) -> list[tuple[bytes, bytes]]:
    kind = fmt.strip().lower()
    metrics = named_metrics(engines, log_stats)
    if kind == "text":
        value = "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in metrics)
    elif kind == "json":
        value = "JSON " + json.dumps({"named_metrics": dict(metrics)})
    else:
        return []
    return [(b"endpoint-load-metrics", value.encode())]
