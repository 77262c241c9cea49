"""Requests sent while a replica is frozen (SIGSTOP): both frozen-replica suites' load."""

from __future__ import annotations

import threading
import time

import openai

from tests.support.gateway import metric_values


def held_on(base: str, replica: str) -> float:
    """Requests the gateway at ``base`` counts in flight on ``replica`` (its host:port)."""
    values = metric_values(base, "kvgate_inflight_requests")
    return sum(v for k, v in values.items() if replica in k)


def ask_until_two_wait(
    client: openai.OpenAI, base: str, frozen_id: str, model: str, tag: str
) -> tuple[int, list[str]]:
    """Send small chat requests, streamed and not, every 50 ms until two wait on the frozen
    replica (40 at most); join them. Returns (how many were sent, each one's outcome: "ok"
    or the error's repr)."""
    outcomes: list[str] = []

    def ask(i: int, stream: bool) -> None:
        try:
            out = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"{tag} {i} " * 50}],
                max_tokens=4, stream=stream)
            if stream:
                assert isinstance(out, openai.Stream)
                sum(1 for _ in out)
            outcomes.append("ok")
        except openai.APIError as exc:
            outcomes.append(repr(exc))

    asked: list[threading.Thread] = []
    while held_on(base, frozen_id) < 2 and len(asked) < 40:
        n = len(asked)  # streamed and not, to both replicas
        asked.append(threading.Thread(target=ask, args=(n, n // 2 % 2 == 1)))
        asked[-1].start()
        time.sleep(0.05)
    for t in asked:
        t.join(timeout=40)
    return len(asked), outcomes
