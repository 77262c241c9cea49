"""Under flow control a retry goes only to a fallback with room. A request's first try on a
hung replica is cut at the first-byte timeout; its fallback, free when it was picked, filled
meanwhile (another request the pool's bound let through to it). The retry was sent there
anyway: the replica held two requests against ``max_inflight: 1`` while the queue held others
back for that bound. Now the request ends with its try's 504 (never served: not charged) and
the fallback keeps its one request.

Two real simulators (``engine_hang`` switched at run time), a real gateway with flow control,
the official openai client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

ASK: dict[str, Any] = {"model": "llama", "max_tokens": 50, "stream": True,
                       "messages": [{"role": "user", "content": "hello"}]}
FIRST_BYTE_S = 8  # the setup below (a few requests) fits in it on a loaded machine


def _received(sim: str) -> int:
    reqs = httpx.get(f"{sim}/sim/requests", timeout=10).json()["requests"]
    return sum(1 for r in reqs if r["path"] == "/v1/chat/completions")


def test_a_retry_does_not_overfill_a_fallback_that_filled_meanwhile(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    sims = [sim_factory("--time-scale", "50", "--engine-hang", model="m")[1] for _ in range(2)]
    config = {"pools": {"p": {"served_model": "m", "replicas": sims}},
              "models": {"llama": {"default": "p"}},
              "flow": {"enabled": True, "max_inflight": 1},
              "upstream": {"first_byte_timeout_s": FIRST_BYTE_S},
              "health": {"interval_s": 0.2, "timeout_s": 0.5, "stall_after_s": None,
                         "failure_threshold": 1000}}
    gw, base = gateway_proc(config=config)
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        outcome: list[object] = []

        def first() -> None:
            try:
                outcome.append([c for c in client.chat.completions.create(**ASK)])
            except openai.APIStatusError as exc:
                outcome.append(exc.status_code)

        x = threading.Thread(target=first, daemon=True)
        x.start()
        wait_for(lambda: sum(map(_received, sims)) == 1, 20, "the first request on a replica")
        hung, other = sims if _received(sims[0]) == 1 else sims[::-1]
        # the other replica answers now, and holds its streams after two tokens
        httpx.post(f"{other}/sim/faults", json={"engine_hang": False, "hang_after_tokens": 2},
                   timeout=10)
        held = client.chat.completions.create(**ASK)
        next(iter(held))  # it runs on the other replica: the pool's bound is reached there
        wait_for(lambda: not x.is_alive() or _received(other) > 1, FIRST_BYTE_S + 40,
                 "the first request cut")
        assert _received(other) == 1  # (the retry went there before, a second request)
        x.join(20)
        assert outcome == [504], outcome
        assert _received(hung) == 1
        held.close()
        wait_for(lambda: inflight(base) == 0, 20, "nothing in flight")
        assert sum(metric_values(base, "kvgate_flow_queue_depth").values()) == 0
