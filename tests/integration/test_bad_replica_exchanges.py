"""The scripted replica the byte-level tests use (`tests.support.bad_replica`) answers each
request by the settings it had when that request arrived: a test that sets up its next
answer as soon as the last one reached it does not change the exchange still running there.

It did: `test_huge_answers`' stream test failed once in CI, the gateway's POST waiting 20 s
for an answer head. The test before it had its whole answer; the replica's thread, not yet
scheduled after writing it, then read the stream test's ``rest`` and held that kept-alive
connection on a gate set only once the stream's first event came -- through that very
connection, which the gateway reused."""

from __future__ import annotations

import httpx

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, chunked, sse_head, whole

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def test_what_a_test_sets_after_an_answer_is_for_the_next_request() -> None:
    with BadReplica("m") as replica, httpx.Client(timeout=10) as client:
        replica.answer = whole(CHAT_ANSWER)
        # the exchange goes on after its answer is whole: a pause, then nothing more to send
        replica.drip, replica.drip_s = [b""], 1.0
        first = client.post(f"{replica.url}/v1/chat/completions", content=b"{}")
        assert first.content == CHAT_ANSWER
        # the next request's settings, made while the first exchange is still in its pause
        replica.drip = []
        replica.answer = sse_head() + chunked(EVENT, last=False)
        replica.rest = chunked(DONE)
        try:  # on the same kept-alive connection, as the gateway's pool sends it
            with client.stream("POST", f"{replica.url}/v1/chat/completions",
                               content=b"{}") as resp:
                chunks = resp.iter_bytes()
                got = next(chunks)  # (the first exchange held it: a ReadTimeout here)
                replica.gate.set()
                got += b"".join(chunks)
        finally:
            replica.gate.set()
        assert got == EVENT + DONE
        assert replica.posts == 2
