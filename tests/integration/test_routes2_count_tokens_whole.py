"""``"stream": true`` sent to ``/v1/messages/count_tokens`` (a route that never streams) is
still a whole answer at the HTTP edge: bounded by the total timeout, not cut at the
first-byte timeout as a stream is (it was: a slow count_tokens answered 504 while the same
answer without the field was waited for). A real `kvgate serve` before a scripted replica
(`BadReplica`) that holds its answers until the test releases them; a streamed
/v1/messages sent after it shows the first-byte timeout passed."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.bad_replica import BadReplica, behind_a_gateway, whole
from tests.support.gateway import inflight, wait_for

MODEL = "m"
TURNS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def edge() -> Iterator[tuple[BadReplica, str]]:
    with behind_a_gateway(MODEL, env={"KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "1",
                                      "KVGATE_UPSTREAM__TOTAL_TIMEOUT_S": "60"}) as made:
        yield made


def test_a_streamed_count_tokens_waits_past_the_first_byte_timeout(
    edge: tuple[BadReplica, str],
) -> None:
    replica, base = edge
    replica.answer, replica.rest = b"", whole(orjson.dumps({"input_tokens": 3}))
    got: list[httpx.Response] = []

    def count() -> None:
        got.append(httpx.post(f"{base}/v1/messages/count_tokens", timeout=60, json={
            "model": MODEL, "messages": TURNS, "stream": True}))

    counting = threading.Thread(target=count)
    counting.start()
    wait_for(lambda: replica.posts == 1, what="count_tokens at the replica")
    streamed = httpx.post(f"{base}/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": TURNS, "stream": True})
    assert streamed.status_code == 504  # the first-byte timeout passed for both
    replica.gate.set()
    counting.join(60)
    assert got and got[0].status_code == 200, got[0].text if got else "no answer"
    assert got[0].json() == {"input_tokens": 3}
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
