"""An answer a replica sends compressed (`Content-Encoding: gzip`) although kvgate asks for
identity: a proxy in front of the replica that compresses anyway. kvgate relayed the gzip
bytes as a 200 `application/json` without their `Content-Encoding`, so the official client
failed to decode JSON (and the usage went uncounted). Now it is a failure of that replica:
retried on another one before anything reached the client, else a 502 in OpenAI's shape.

A real gateway, the official openai client, a loopback replica that compresses, a simulated
one that does not.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable

import openai
import orjson
import pytest

from tests.support.bad_replica import BadReplica
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

MODEL = "m"
ANSWER = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "hello"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def _gzipped(body: bytes) -> bytes:
    packed = gzip.compress(body)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n" % len(packed) + packed)


def _ask(base: str) -> str | None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=15)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return answer.choices[0].message.content


def test_a_lone_replica_answering_compressed_is_a_502() -> None:
    with BadReplica(MODEL, answer=_gzipped(ANSWER)) as bad:
        gw, base = gateway_proc(upstreams=[bad.url])
        with gw:
            with pytest.raises(openai.APIStatusError) as err:
                _ask(base)
            assert err.value.status_code == 502
            assert bad.posts == 1


def test_a_compressed_answer_is_retried_on_another_replica(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory(model=MODEL)
    with BadReplica(MODEL, answer=_gzipped(ANSWER)) as bad:
        gw, base = gateway_proc(upstreams=[bad.url, sim], args=["--policy", "round_robin"])
        with gw:
            for _ in range(4):
                assert _ask(base)
            assert bad.posts >= 1  # the compressing replica was tried, and passed over
