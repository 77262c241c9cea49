"""The gateway's metrics: replica state read at scrape time, the hit ratio from counter deltas,
which streamed chunk counts as the first token, and draining replicas in the exposition."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config
from gateway.metrics import GatewayMetrics
from gateway.pool import Pools
from gateway.replicas import HealthRules, Replica
from gateway.scrape import Sample
from gateway.sse import carries_output

POLICY = HealthRules()
Key = tuple[str, tuple[tuple[str, str], ...]]


def samples(metrics: GatewayMetrics) -> dict[Key, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def key(name: str, replica: str = "r:1", pool: str = "p") -> Key:
    return name, (("pool", pool), ("replica", replica))


@pytest.mark.parametrize(
    ("scrapes", "expected"),
    [
        ([(0, 0), (50, 100)], 0.5),  # hits, queries counters at each scrape
        ([(0, 0), (50, 100), (50, 100)], 0.5),  # idle interval keeps the last ratio
        ([(0, 0), (50, 100), (150, 200)], 1.0),  # only the latest interval counts
        ([(50, 100), (0, 10)], None),  # counters went back (restart): no ratio yet
        ([(0, 0)], None),  # one scrape: no interval
        ([(None, None), (5, 10)], None),  # the page did not carry the counters
    ],
)
def test_hit_ratio_from_counter_deltas(
    scrapes: list[tuple[float | None, float | None]], expected: float | None
) -> None:
    r = Replica("p", "http://r:1", POLICY)
    for i, (hits, queries) in enumerate(scrapes):
        r.record_scrape(Sample(prefix_cache_hits=hits, prefix_cache_queries=queries), float(i))
    assert r.hit_ratio == expected


def test_replica_state_is_read_at_scrape_time() -> None:
    r = Replica("p", "http://r:1", POLICY)
    fresh = Replica("p", "http://r:2", POLICY)  # never scraped: no engine series, age absent
    now = [10.0]
    metrics = GatewayMetrics(lambda: [r, fresh], lambda: now[0],
                             scrape_errors=lambda rid: 3 if rid == "r:1" else 0,
                             affinity=lambda: {"r:1": 42})
    r.record_scrape(Sample(waiting=2, running=5, kv_usage=0.25, prefix_cache_hits=0,
                           prefix_cache_queries=0), 8.0)
    r.record_scrape(Sample(waiting=4, running=6, kv_usage=0.5, prefix_cache_hits=30,
                           prefix_cache_queries=40), 9.0)
    lease = r.acquire(100)
    got = samples(metrics)
    assert got[key("kvgate_replica_waiting")] == 4
    assert got[key("kvgate_replica_running")] == 6
    assert got[key("kvgate_replica_kv_usage")] == 0.5
    assert got[key("kvgate_replica_prefix_cache_hit_ratio")] == 0.75
    assert got[key("kvgate_replica_scrape_age_seconds")] == 1.0
    assert got[key("kvgate_scrape_errors_total")] == 3
    assert got[key("kvgate_affinity_index_entries")] == 42
    assert got[key("kvgate_inflight_requests")] == 1
    assert got[key("kvgate_replica_healthy")] == 1
    assert key("kvgate_replica_waiting", "r:2") not in got
    assert key("kvgate_replica_scrape_age_seconds", "r:2") not in got
    assert got[key("kvgate_affinity_index_entries", "r:2")] == 0
    lease.release()
    now[0] = 20.0  # the age grows between two renders with no request in between
    assert samples(metrics)[key("kvgate_replica_scrape_age_seconds")] == 11.0
    assert samples(metrics)[key("kvgate_inflight_requests")] == 0


async def test_a_draining_replica_is_described_until_reaped() -> None:  # a loop: transports
    cfg = load_config("", overrides={"pools": {"p": {"replicas": ["http://r:1", "http://r:2"]}},
                                     "models": {}}, quick=True)
    pools = Pools(cfg)
    metrics = GatewayMetrics(pools.described, lambda: 0.0)
    leaving = pools.by_name["p"].by_id["r:1"]
    lease = leaving.acquire(10)
    changes = pools.set_discovered("p", frozenset({"http://r:2"}))
    assert [r.id for r in changes.removed] == ["r:1"] and not changes.added
    assert [r.id for r in pools.replicas()] == ["r:2"]  # no new picks
    got = samples(metrics)
    assert got[key("kvgate_replica_healthy")] == 0 and got[key("kvgate_inflight_requests")] == 1
    assert pools.reap() == []  # still in flight
    lease.release()
    assert pools.reap() == [leaving]
    assert key("kvgate_inflight_requests") not in samples(metrics)
    await pools.close()


async def test_a_replica_back_while_draining_keeps_its_counters() -> None:  # a loop: transports
    cfg = load_config("", overrides={"pools": {"p": {"replicas": ["http://r:1"]}},
                                     "models": {}}, quick=True)
    pools = Pools(cfg)
    first = pools.by_name["p"].by_id["r:1"]
    first.acquire(10)
    pools.set_discovered("p", frozenset())
    changes = pools.set_discovered("p", frozenset({"http://r:1"}))
    assert changes.added == [first] and not first.draining and first.inflight == 1
    assert pools.draining == []
    await pools.close()


@pytest.mark.parametrize(
    ("chunk", "content"),
    [
        (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', False),
        (b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n', True),
        (b'data: {"choices":[{"delta":{"content": "lo"}}]}\n\n', True),
        (b'data: {"choices":[{"text":"Once","index":0}]}\n\n', True),
        (b'data: {"choices":[{"text":"","index":0}]}\n\n', False),
        (b'data: {"choices":[{"delta":{"reasoning_content":"Let me"}}]}\n\n', True),
        # vLLM 0.34 reasoning models stream `reasoning` (entrypoints/generate/base/protocol.py)
        (b'data: {"choices":[{"delta":{"reasoning":"Let me"}}]}\n\n', True),
        (b'data: {"choices":[{"delta":{"reasoning":""}}]}\n\n', False),
        (b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\\""}}]}}]}\n\n',
         True),
        (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
         b'"delta":"Hi"}\n\n', True),
        (b"data: [DONE]\n\n", False),
        (b": keep-alive\n\n", False),
    ],
)
def test_which_chunk_counts_as_the_first_token(chunk: bytes, content: bool) -> None:
    assert carries_output(chunk) is content
