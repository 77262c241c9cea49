"""A pool's context length (``max_model_len``, its /v1/models card and the cap of its TPM
reservations) is its replicas' longest: one that left takes its length along."""

from __future__ import annotations

from gateway.config import load_config
from gateway.pool import Pools

SHORT, LONG, NEW = "http://127.0.0.1:9101", "http://127.0.0.1:9102", "http://127.0.0.1:9103"


async def test_a_replica_that_left_takes_its_context_length_along() -> None:
    cfg = load_config("", overrides={"pools": {"p": {"served_model": "m",
                                                     "replicas": [SHORT, LONG]}},
                                     "models": {}}, quick=True)
    pools = Pools(cfg)
    try:
        pool = pools.by_name["p"]
        short, long = pool.replicas
        short.max_model_len, long.max_model_len = 2048, 16384  # as `HealthMonitor` learned
        pool.max_model_len = 16384
        pools.set_discovered("p", frozenset({SHORT}))
        assert pool.max_model_len == 2048  # (it said 16384: no replica of the pool takes it)
        pools.set_discovered("p", frozenset({NEW}))  # none of them said theirs yet
        assert pool.max_model_len == 2048
    finally:
        await pools.close()
