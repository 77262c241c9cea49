"""An older vLLM answers a request to its sleeping engine 503 with a ModelSleepingError ("the
model is sleeping"), and exports no `vllm:engine_sleep_state`. kvgate counted each such
answer as a failure: three ejected the replica, for a back-off that grew each time, and
/readyz said "ejected after failed requests". It is asleep: out of rotation with that reason,
no failure counted, and back once a request finds it awake. Real gateway, a real HTTP replica
on loopback, the openai client."""

from __future__ import annotations

import httpx
import openai
import orjson

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, whole
from tests.support.gateway import gateway_proc, wait_for

SLEEPING = orjson.dumps({
    "object": "error", "message": "The model is sleeping. Wake it up with POST /wake_up.",
    "type": "ModelSleepingError", "param": None, "code": 503})


def _ask(base: str) -> int:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        client.chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def test_a_sleeping_503_puts_the_replica_to_sleep_not_out_for_failures() -> None:
    with BadReplica("m", answer=whole(SLEEPING, status=503)) as replica:
        gw, base = gateway_proc(config={"pools": {"p": {"served_model": "m",
                                                         "replicas": [replica.url]}}})
        with gw:
            for _ in range(5):  # past the failure threshold (3)
                assert _ask(base) == 503
            ready = httpx.get(f"{base}/readyz", timeout=5)
            assert "the model is sleeping" in ready.text, ready.text
            assert "ejected" not in ready.text
            assert 1 <= replica.posts < 5  # kept out: the others were answered by kvgate
            replica.answer = whole(CHAT_ANSWER)  # woken up
            wait_for(lambda: _ask(base) == 200, timeout=30, what="the replica back when awake")
            assert httpx.get(f"{base}/readyz", timeout=5).status_code == 200
