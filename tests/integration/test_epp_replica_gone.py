"""A replica gone since the last health probe (its port refuses connections): the HTTP edge
marks it down at once and, no replica left, answers the pool's 503 with Retry-After -- what
the next request gets. Behind Envoy the connect failure is Envoy's plain-text 503 ("upstream
connect error or disconnect/reset before headers ..."), which the picker read as the
replica's answer ("The upstream replica answered 503.", the replica counted as having
answered, merely failed once); it is now the HTTP edge's answer at both edges.
"""

from __future__ import annotations

import httpx

from tests.support.edges import start_edges
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
BODY = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
# only requests notice the replica's death (no probe for a minute), and it stays out 5 s
HEALTH = {"interval_s": 60, "timeout_s": 0.5, "failure_threshold": 2, "eject_base_s": 5,
          "eject_max_s": 5}


def test_a_refused_connection_is_the_pools_503_at_both_edges() -> None:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(sim.start())
        config = {"pools": {"default": {"served_model": MODEL, "replicas": [url]}},
                  "health": HEALTH}
        bases = {name: edge.base for name, edge in start_edges(procs, config=config).items()}
        for edge in bases.values():
            assert httpx.post(f"{edge}/v1/chat/completions", json=BODY, timeout=10) \
                .status_code == 200
        sim.kill()
        answers = {name: [httpx.post(f"{edge}/v1/chat/completions", json=BODY, timeout=10)
                          for _ in range(2)] for name, edge in bases.items()}
        for name, (first, second) in answers.items():
            for resp in (first, second):
                assert resp.status_code == 503, (name, resp.text)
                assert 1 <= int(resp.headers["retry-after"]) <= 5, name
                assert resp.json()["error"]["type"] == "ServiceUnavailableError", name
            assert first.json() == second.json(), name  # the first answer is the next one's
        assert answers["http"][0].json() == answers["envoy"][0].json()
    finally:
        for proc in reversed(procs):
            proc.stop()
