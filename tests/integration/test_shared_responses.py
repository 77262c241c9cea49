"""Responses API ids across gateways (real Redis, real gateways and simulators, the openai
client): a response stored through gateway A is found through gateway B -- the follow-up with
`previous_response_id` goes to the replica holding it, and so do GET and cancel. With Redis
stopped, B answers a GET of an id it cannot look up 503 (to retry), without waiting long."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack

import openai
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc, redis_proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def test_a_response_stored_through_one_gateway_is_found_through_another(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    sims = [sim_factory("--time-scale", "50", "--enable-store")[1] for _ in range(4)]
    redis, url = redis_proc()
    config = {"pools": {"p": {"replicas": sims, "served_model": MODEL}},
              "models": {MODEL: {"default": "p"}}, "routing": {"policy": "round_robin"}}
    with ExitStack() as stack:
        stack.enter_context(redis)
        bases = []
        for _ in range(2):
            proc, base = gateway_proc(config=config, env={"KVGATE_REDIS_URL": url})
            stack.enter_context(proc)
            bases.append(base)
        a, b = (_client(x) for x in bases)
        for _ in range(3):  # round robin over 4 replicas: without sharing most would miss
            raw = a.responses.with_raw_response.create(
                model=MODEL, input="Hello", max_output_tokens=4)
            first, home = raw.parse(), raw.headers["x-kvgate-replica"]
            follow = b.responses.with_raw_response.create(
                model=MODEL, input="And then?", max_output_tokens=4,
                previous_response_id=first.id)
            assert follow.headers["x-kvgate-replica"] == home
            assert follow.headers["x-kvgate-route"] == "response-affinity"
            got = b.responses.with_raw_response.retrieve(first.id)
            assert got.parse().id == first.id and got.headers["x-kvgate-replica"] == home
        with pytest.raises(openai.NotFoundError):  # an id nobody relayed stays unknown
            b.responses.retrieve("resp_nobody_made_this")

        redis.stop()
        made = a.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:  # B cannot learn of it:
            b.responses.retrieve(made.id)  # a 503 to retry, not a 404 saying it is gone
        assert caught.value.status_code == 503
        assert time.monotonic() - started < 5
