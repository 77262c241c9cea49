"""Short conversations keep their replica from the second turn on, through two gateways.

A system prompt and a question are ~100 characters: less than one prefix block (256). Such a
conversation had no chain until it outgrew a block, so its first turns were placed on load
alone: 5 of 5 conversations moved within their first three turns (each move computes the
conversation's prefix again). A chat's opening (through its first user message) now leads its
chain (`routing.features`). Real redis-server, gateways and simulators, the openai client."""

from __future__ import annotations

import time
from collections.abc import Callable

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.test_shared_routing import MODEL, _gateways, _peers
from tests.support.gateway import wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow


def test_short_conversations_alternating_between_gateways_keep_their_replica(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]]
) -> None:
    fleet = [sim_factory()[1] for _ in range(4)]
    stack, bases = _gateways(redis_url, fleet)
    with stack:
        wait_for(lambda: all(_peers(b) == 1 for b in bases), what="gateways see each other")
        clients = [openai.OpenAI(base_url=f"{b}/v1", api_key="unused", max_retries=0,
                                 timeout=30) for b in bases]
        for c in range(5):
            messages: list[ChatCompletionMessageParam] = [
                {"role": "system", "content": "You are a helpful assistant. Answer briefly, "
                 "in plain words, and say so when you do not know."},
                {"role": "user", "content": f"Question from user {c}: what is topic {c}, "
                 "and where can I read more about it?"}]
            seen = []
            for t in range(6):
                raw = clients[t % 2].chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=12)
                seen.append(raw.headers["x-kvgate-replica"])
                messages += [{"role": "assistant",
                              "content": raw.parse().choices[0].message.content or ""},
                             {"role": "user", "content": f"And after that, point {t}?"}]
                time.sleep(0.05)  # a client reads its answer: past the gateways' sync window
            assert len(set(seen)) == 1, seen  # every turn on the first turn's replica
