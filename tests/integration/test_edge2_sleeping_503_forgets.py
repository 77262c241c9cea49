"""A replica put to sleep by its own 503 ("the model is sleeping": an older vLLM, no
`vllm:engine_sleep_state` to scrape) lost its KV cache as one a scrape finds asleep does, but
kvgate kept the prefixes it remembered there: the next requests of those prefixes were pinned
to a cache that no longer exists. Both ways of falling asleep forget them. Real gateway, a
real HTTP replica on loopback, the openai client."""

from __future__ import annotations

from typing import Any

import openai
import orjson

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, whole
from tests.support.gateway import gateway_proc, metric_values, wait_for

SLEEPING = orjson.dumps({
    "object": "error", "message": "The model is sleeping. Wake it up with POST /wake_up.",
    "type": "ModelSleepingError", "param": None, "code": 503})
# long enough to fill several vLLM cache blocks: remembered where it was answered
MSG: list[Any] = [{"role": "user", "content": "the same long shared prefix " * 40}]


def _ask(base: str) -> int:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        client.chat.completions.create(model="m", max_tokens=2, messages=MSG)
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


def _remembered(base: str, replica: str) -> float:
    entries = metric_values(base, "kvgate_affinity_index_entries")
    return sum(v for labels, v in entries.items() if f'"{replica}"' in labels)


def test_a_sleeping_503_forgets_the_prefixes_remembered_there() -> None:
    with BadReplica("m", answer=whole(CHAT_ANSWER)) as replica:
        address = replica.url.removeprefix("http://")
        gw, base = gateway_proc(config={"pools": {"p": {"served_model": "m",
                                                         "replicas": [replica.url]}}})
        with gw:
            assert _ask(base) == 200
            wait_for(lambda: _remembered(base, address) > 0, timeout=20,
                     what="the prefix remembered on the replica")
            replica.answer = whole(SLEEPING, status=503)  # put to sleep
            assert _ask(base) == 503
            wait_for(lambda: _remembered(base, address) == 0, timeout=20,
                     what="the prefixes remembered there forgotten")
