"""A failed try that is not retried, though another replica could have answered, is counted:
`kvgate_upstream_retries_refused_total{pool, why}`.

`kvgate_upstream_retries_total` counts the retries that went; a retry the pool's retry budget
refused (its client got the try's error), one flow control's in-flight bound refused, and a
stream that failed after its first events reached the client (no retry can follow) showed
nowhere in /metrics: an operator saw 502s with retries at 0 and could not tell a budget too
small from a replica failing mid-answer.

A real gateway (round robin over two loopback replicas), the official openai client, /metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import openai
import orjson
import pytest

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, chunked, sse_head, whole
from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

MODEL = "m"
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "user", "content": "hi"}]


def refused(base: str) -> dict[str, float]:
    """{why: count} of kvgate_upstream_retries_refused_total."""
    return {k.split('why="')[1].split('"')[0]: v for k, v in metric_values(
        base, "kvgate_upstream_retries_refused_total").items()}


def test_a_retry_the_budget_refuses_is_counted() -> None:
    failing = whole(orjson.dumps({"error": {"message": "bad gateway", "code": 502}}), status=502)
    with BadReplica(MODEL, answer=failing) as bad, BadReplica(MODEL, answer=whole(CHAT_ANSWER)) \
            as good:
        gw, base = gateway_proc(upstreams=[bad.url, good.url], args=["--policy", "round_robin"],
                                env={"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000",
                                     "KVGATE_UPSTREAM__RETRY_BUDGET_MIN": "0",
                                     "KVGATE_UPSTREAM__RETRY_BUDGET_RATIO": "0"})
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            errors = 0
            for _ in range(4):  # round robin: the failing replica is asked first twice
                try:
                    client.chat.completions.create(model=MODEL, messages=MESSAGES)
                except openai.APIStatusError as err:
                    assert err.status_code == 502
                    errors += 1
            assert errors == bad.posts >= 1
            wait_for(lambda: inflight(base) == 0, what="no request left in flight")
            assert refused(base) == {"budget": float(errors)}
            assert not metric_values(base, "kvgate_upstream_retries_total")


CHUNK = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}]}) + b"\n\n"


@pytest.mark.parametrize("end", ["reset", "error_event"])
def test_a_started_stream_that_fails_is_counted_once(end: str) -> None:
    """Round robin over the failing replica and a good one, no retry budget: the stream that
    failed after its start is counted as such, not as a retry the budget refused too."""
    stream = sse_head() + chunked(CHUNK, b"data: [DONE]\n\n")
    with BadReplica(MODEL, end="reset" if end == "reset" else "keep") as bad, \
            BadReplica(MODEL, answer=stream) as good:
        bad.answer = sse_head() + chunked(CHUNK, last=False)
        bad.rest = (b"" if end == "reset" else chunked(b"data: " + orjson.dumps(
            {"error": {"message": "the engine failed", "code": 500}}) + b"\n\n",
            b"data: [DONE]\n\n"))
        gw, base = gateway_proc(upstreams=[bad.url, good.url], args=["--policy", "round_robin"],
                                env={"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000",
                                     "KVGATE_UPSTREAM__RETRY_BUDGET_MIN": "0",
                                     "KVGATE_UPSTREAM__RETRY_BUDGET_RATIO": "0"})
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            failed = 0
            for _ in range(2):  # round robin: one each
                texts = []
                try:
                    for chunk in client.chat.completions.create(
                            model=MODEL, messages=MESSAGES, stream=True):
                        texts.append(chunk.choices[0].delta.content)
                        bad.gate.set()
                except openai.APIError:
                    failed += 1
                assert texts == ["hello"]
            assert failed == bad.posts == good.posts == 1
            wait_for(lambda: inflight(base) == 0, what="no request left in flight")
            assert refused(base) == {"started": 1.0}


def _chats(sim: str) -> int:
    reqs = httpx.get(f"{sim}/sim/requests", timeout=10).json()["requests"]
    return sum(1 for r in reqs if r["path"] == "/v1/chat/completions")


def test_a_retry_flow_control_refuses_is_counted(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    """Flow control (`max_inflight: 1`): the request waits on its replica (a latency fault),
    the other replica's one slot fills meanwhile, then the first one's process dies: no
    fallback has room (the answer: tests/integration/test_tenancy7_retry_refused.py)."""
    procs = [sim_factory("--time-scale", "50", model="m") for _ in range(2)]
    sims = [url for _, url in procs]
    for sim in sims:
        httpx.post(f"{sim}/sim/faults", json={"latency_ms": 4000}, timeout=10)
    config = {"pools": {"p": {"served_model": "m", "replicas": sims}},
              "models": {"llama": {"default": "p"}},
              "flow": {"enabled": True, "max_inflight": 1},
              "health": {"interval_s": 0.2, "timeout_s": 0.5, "stall_after_s": None,
                         "failure_threshold": 1000}}
    gw, base = gateway_proc(config=config)
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        outcome: list[BaseException | object] = []

        def call(tokens: int) -> None:
            try:
                outcome.append(client.chat.completions.create(
                    model="llama", messages=MESSAGES, max_tokens=tokens))
            except openai.APIStatusError as exc:
                outcome.append(exc)

        first = threading.Thread(target=call, args=(50,), daemon=True)
        first.start()
        wait_for(lambda: sum(map(_chats, sims)) == 1, 20, "the request on a replica")
        failing, other = sims if _chats(sims[0]) == 1 else sims[::-1]
        second = threading.Thread(target=call, args=(5,), daemon=True)
        second.start()  # to the other replica: its one slot taken
        wait_for(lambda: _chats(other) == 1, 20, "the second request on the other replica")
        procs[sims.index(failing)][0].kill()  # its connection reset, nothing answered
        first.join(30)
        second.join(30)
        assert isinstance(outcome[0], openai.APIStatusError), outcome
        wait_for(lambda: inflight(base) == 0, 20, "nothing in flight")
        assert refused(base) == {"flow": 1.0}
