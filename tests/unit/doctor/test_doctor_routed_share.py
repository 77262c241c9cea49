"""A replica sent its fair share is not 'routed around': a tenant over its rate limit got a
burst of 59 requests through at its load's start, 29 and 30 on two replicas, the first ones
decoding slower in that burst (15 vs 9 ms per token, over ~460 tokens), and the doctor said
"slow engine, routed around: ... it started 29 of the pool's 59 requests" -- 49 % of a
two-replica pool, an even split."""

from __future__ import annotations

from gateway.doctor.pool_rules import classify_pool
from tests.unit.doctor.test_rules import CTX, TH, classes, pool, replica


def _burst(requests: float, total: float = 59.0) -> list[str]:
    fast = replica("fast", requests=total - requests, itl_mean=0.009, itl_n=470.0, samples=11,
                   fresh=11, ttft_mean=0.008, inflight_mean=1.2)
    slower = replica("slower", requests=requests, itl_mean=0.015, itl_n=460.0, samples=11,
                     fresh=11, ttft_mean=0.009, inflight_mean=1.4)
    return classes(classify_pool(pool(fast, slower, requests=total, samples=11), TH, CTX))


def test_an_even_split_is_not_routed_around() -> None:
    assert _burst(29.0) == ["healthy"]
    assert _burst(23.0, 51.0) == ["healthy"]  # 45 % (seen too, 2.8x slower in its burst)


def test_a_replica_sent_clearly_less_is_still_named() -> None:
    assert _burst(12.0) == ["routing"]  # 20 % of the pool's requests, 1.7x slower
