"""`kvgate_upstream_retries_refused_total{why="started"}` counts a started stream that failed
only when another replica could have answered it, as its help text says: a pool whose only
replica fails mid-stream has no retry to refuse. It was counted there too, so an operator of
a one-replica pool saw "retries refused" that no retry could ever have taken.

A real gateway over one loopback replica (and over two, where it is counted), the official
openai client, /metrics.
"""

from __future__ import annotations

import openai
import orjson
import pytest

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for

MODEL = "m"
CHUNK = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}]}) + b"\n\n"


def _refused(base: str) -> dict[str, float]:
    return {k.split('why="')[1].split('"')[0]: v for k, v in metric_values(
        base, "kvgate_upstream_retries_refused_total").items()}


@pytest.mark.parametrize("end", ["reset", "error_event"])
def test_a_started_stream_of_a_pool_s_only_replica_is_no_retry_refused(end: str) -> None:
    with BadReplica(MODEL, end="reset" if end == "reset" else "keep") as bad:
        bad.answer = sse_head() + chunked(CHUNK, last=False)
        bad.rest = (b"" if end == "reset" else chunked(b"data: " + orjson.dumps(
            {"error": {"message": "the engine failed", "code": 500}}) + b"\n\n",
            b"data: [DONE]\n\n"))
        gw, base = gateway_proc(upstreams=[bad.url],
                                env={"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            texts = []
            with pytest.raises(openai.APIError):
                for chunk in client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}],
                        stream=True):
                    texts.append(chunk.choices[0].delta.content)
                    bad.gate.set()
            assert texts == ["hello"] and bad.posts == 1
            wait_for(lambda: inflight(base) == 0, what="no request left in flight")
            assert metric_values(base, "kvgate_requests_total")  # /metrics answered
            assert _refused(base) == {}
