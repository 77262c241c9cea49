"""A request whose retry flow control did not send (its try failed, and the pool's other
replicas are at their in-flight bound): the answer names the bound and when to come back, as
flow control's refusal of a request of its band at a full queue does (429, Retry-After). It
was the failed try's own error, a 502 without Retry-After.

Two real simulators (one made to fail every request), a real gateway with flow control
(`max_inflight: 1`), the official openai client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import Proc

ASK: dict[str, Any] = {"model": "llama", "max_tokens": 50,
                       "messages": [{"role": "user", "content": "hello"}]}


def _chats(sim: str) -> int:
    reqs = httpx.get(f"{sim}/sim/requests", timeout=10).json()["requests"]
    return sum(1 for r in reqs if r["path"] == "/v1/chat/completions")


def test_a_retry_with_no_room_is_answered_with_the_bound_and_retry_after(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    """The request waits on its replica (a latency fault), the other replica fills with a
    stream meanwhile, then the first one's process dies: no fallback with room."""
    procs = [sim_factory("--time-scale", "50", model="m") for _ in range(2)]
    sims = [url for _, url in procs]
    for sim in sims:
        httpx.post(f"{sim}/sim/faults", json={"latency_ms": 4000}, timeout=10)
    config = {"pools": {"p": {"served_model": "m", "replicas": sims}},
              "models": {"llama": {"default": "p"}},
              # the default tier below the top band: a full queue sheds it with a 429
              "tiers": {"default": {"flow": {"band": 1}}, "gold": {"flow": {"band": 0}}},
              "flow": {"enabled": True, "max_inflight": 1},
              "health": {"interval_s": 0.2, "timeout_s": 0.5, "stall_after_s": None,
                         "failure_threshold": 1000}}
    gw, base = gateway_proc(config=config)
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        outcome: list[BaseException | object] = []

        def call(**extra: Any) -> None:
            try:
                outcome.append(client.chat.completions.create(**{**ASK, **extra}))
            except openai.APIStatusError as exc:
                outcome.append(exc)

        first = threading.Thread(target=call, daemon=True)
        first.start()
        wait_for(lambda: sum(map(_chats, sims)) == 1, 20, "the request on a replica")
        failing, other = sims if _chats(sims[0]) == 1 else sims[::-1]
        second = threading.Thread(target=call, kwargs={"max_tokens": 5}, daemon=True)
        second.start()  # to the other replica: its one slot taken
        wait_for(lambda: _chats(other) == 1, 20, "the second request on the other replica")
        procs[sims.index(failing)][0].kill()  # its connection reset, nothing answered
        first.join(30)
        second.join(30)
        err = outcome[0]
        assert isinstance(err, openai.RateLimitError), outcome
        assert err.status_code == 429
        assert int(err.response.headers["retry-after"]) >= 1
        body = err.response.json()["error"]
        assert "in-flight bound (max_inflight 1)" in body["message"], body
        assert "The replica that took this request failed (" in body["message"], body
        assert body["code"] == "queue_shed" and "Traceback" not in err.response.text
        assert _chats(other) == 1  # the retry was not sent there
        assert not isinstance(outcome[1], BaseException), outcome
        wait_for(lambda: inflight(base) == 0, 20, "nothing in flight")

