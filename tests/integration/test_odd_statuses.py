"""Answers whose status line is not a final HTTP answer. A status HTTP does not have (600 and
above, or under 100) made uvicorn raise while sending it on: the client's connection was
dropped without an answer and the gateway logged a traceback. An interim answer (103 Early
Hints from a proxy in front of the replica, 100 Continue) arriving before the real one, in its
own read, was taken for the answer: kvgate sent the 1xx on as final and the client waited for
an answer that never came. Now an interim answer is skipped and the answer after it relayed,
and an impossible status is a failure of the replica: retried elsewhere, else a 502.

A real gateway, the official openai client, a loopback replica sending the status lines.
"""

from __future__ import annotations

import openai
import pytest

from tests.support.bad_replica import CHAT_ANSWER as ANSWER
from tests.support.bad_replica import BadReplica, whole
from tests.support.gateway import gateway_proc

MODEL = "m"


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)


def _ask(client: openai.OpenAI) -> str | None:
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return answer.choices[0].message.content


@pytest.mark.parametrize("status", [b"999", b"600", b"099"])
def test_a_status_http_does_not_have_is_a_502(status: bytes) -> None:
    odd = b"HTTP/1.1 %s Odd\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(ANSWER), ANSWER)
    with BadReplica(MODEL, answer=odd) as bad:
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            with pytest.raises(openai.APIStatusError) as err:
                _ask(_client(base))
            assert err.value.status_code == 502
            assert "Traceback" not in gw.output(None)


@pytest.mark.parametrize("interim", [b"103 Early Hints\r\nlink: </style.css>", b"100 Continue"])
def test_an_interim_answer_is_skipped_for_the_answer_after_it(interim: bytes) -> None:
    with BadReplica(MODEL, answer=b"HTTP/1.1 %s\r\n\r\n" % interim) as bad:
        bad.drip, bad.drip_s = [whole(ANSWER)], 0.3  # the answer in a later read
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            assert _ask(_client(base)) == "hello"
