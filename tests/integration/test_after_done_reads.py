"""After a stream's ``data: [DONE]`` the client gets what the replica still sends as part of
that stream, and nothing of kvgate's: the body's end is waited for a second in all from the
[DONE], and a cut or a silence there ends the stream as whole (a 200, no failure charged).

Before, a read after the [DONE] that followed a keep-alive comment (or a field without data,
or an event) was not bounded at all, so a reset there sent a 502 error event after the
[DONE], and a replica dripping comments held the stream until the idle timeout, which sent
a 504 error event after it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.support.bad_replica import BadReplica, End, behind_a_gateway, chunked, sse_head
from tests.support.gateway import (
    inflight,
    metric_values,
    request_statuses,
    wait_for,
)

MODEL = "m"
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
COMMENT = b": keep-alive\n\n"


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str]]:
    with behind_a_gateway(MODEL, {"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "10"}) as (replica, base):
        yield replica, base


@pytest.fixture
def replica(gw: tuple[BadReplica, str]) -> Iterator[BadReplica]:
    replica = gw[0]
    replica.answer = sse_head() + chunked(EVENT + DONE, last=False)
    replica.gate = threading.Event()
    yield replica
    replica.gate.set()
    replica.drip, replica.rest, replica.end = [], b"", "keep"


def _stream(base: str) -> bytes:
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "stream": True,
            "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.status_code == 200
        return resp.read()


def _whole(base: str) -> None:
    """The request counted a 200 and its replica no failure."""
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
    assert set(request_statuses(base)) == {"200"}
    assert sum(metric_values(base, "kvgate_replica_failures_total").values()) == 0


@pytest.mark.parametrize(
    ("after", "end"),
    [(COMMENT, "reset"), (EVENT, "reset"), (b"retry: 10\n\n", "keep"), (COMMENT, "keep")],
    ids=["comment-reset", "event-reset", "retry-held", "comment-held"])
def test_what_follows_the_done_is_relayed_and_nothing_after_it(
    gw: tuple[BadReplica, str], replica: BadReplica, after: bytes, end: End,
) -> None:
    base = gw[1]
    replica.drip, replica.drip_s = [chunked(after, last=False)], 0.2  # (a read of its own)
    replica.end = end
    if end == "keep":
        replica.rest = b"0\r\n\r\n"  # the body's end: never, in this test
    relayed = b":" + after if after.startswith(b"retry") else after  # (a comment line: `sse`)
    assert _stream(base) == EVENT + DONE + relayed
    _whole(base)


def test_comments_after_the_done_do_not_hold_the_stream(
    gw: tuple[BadReplica, str], replica: BadReplica,
) -> None:
    """Each read after the [DONE] had a second of its own: a comment every half second kept
    the stream (its client, its replica's counters) for as long as they came."""
    base = gw[1]
    replica.drip, replica.drip_s = [chunked(COMMENT, last=False)] * 8, 0.5
    replica.rest = b"0\r\n\r\n"  # the body's end: after 4 s of comments (never reached)
    got = _stream(base)
    assert got.startswith(EVENT + DONE)
    after = got[len(EVENT + DONE):]
    assert after == COMMENT * (len(after) // len(COMMENT))  # only what the replica sent ...
    assert len(after) < 8 * len(COMMENT)  # ... in the second after the [DONE]
    _whole(base)
