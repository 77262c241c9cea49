"""A replica (or a proxy in front of it) that sends another answer right after a whole one, to
no request: the client gets the whole answer it asked for, and nothing of the other. kvgate
parsed the second one on as if it were part of the first, and its body was relayed after the
first's: a 200 of two JSON objects back to back, which the official client cannot decode. The
connection is not reused either (nothing it sends after that can be trusted to answer the next
request)."""

from __future__ import annotations

import openai

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, chunked, sse_head, whole
from tests.support.gateway import gateway_proc, inflight

MODEL = "m"
OTHER = b'{"object":"error","message":"nobody asked","code":400}'
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def test_an_answer_sent_after_the_whole_answer_is_not_relayed() -> None:
    with BadReplica(MODEL) as replica:
        gw, base = gateway_proc(upstreams=[replica.url],
                                env={"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=10)
            for declared in (True, False):
                replica.answer = whole(CHAT_ANSWER, declared=declared) + whole(OTHER)
                answer = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}])
                assert answer.http_response.content == CHAT_ANSWER
                assert answer.parse().choices[0].message.content == "hello"
            replica.answer = sse_head() + chunked(CHUNK, DONE) + whole(OTHER)
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
            assert [c.choices[0].delta.content for c in stream] == ["hi"]
            replica.answer = whole(CHAT_ANSWER)
            answer = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert answer.http_response.content == CHAT_ANSWER
            assert inflight(base) == 0
