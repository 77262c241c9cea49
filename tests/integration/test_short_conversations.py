"""Short conversations keep their replica from the second turn on, through one gateway and
through two.

A system prompt and a question are ~100 characters: less than one prefix block (256). Such a
conversation had no chain until it outgrew a block, so its first turns were placed on load
alone: 5 of 5 conversations moved within their first three turns (each move computes the
conversation's prefix again). A chat's opening (through its first user message) now leads its
chain (`routing.features`). Through one gateway, 6 of 8 still moved: the replica's last scrape,
taken while the previous turn ran, still counted it running when the next turn came
(`routing.load.still_running`). Real redis-server, gateways and simulators, the openai
client."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.integration.test_shared_routing import MODEL, _gateways, _peers
from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow


def _replicas_of_turns(
    clients: Sequence[openai.OpenAI], c: int, turns: int = 6, max_tokens: int = 12
) -> list[str]:
    """Conversation ``c``'s turns, each through the next client in turn: their replicas."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly, "
         "in plain words, and say so when you do not know."},
        {"role": "user", "content": f"Question from user {c}: what is topic {c}, "
         "and where can I read more about it?"}]
    seen = []
    for t in range(turns):
        raw = clients[t % len(clients)].chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens)
        seen.append(raw.headers["x-kvgate-replica"])
        messages += [{"role": "assistant",
                      "content": raw.parse().choices[0].message.content or ""},
                     {"role": "user", "content": f"And after that, point {t}?"}]
        time.sleep(0.05)  # a client reads its answer: past the gateways' sync window
    return seen


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def test_short_conversations_alternating_between_gateways_keep_their_replica(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]]
) -> None:
    fleet = [sim_factory()[1] for _ in range(4)]
    stack, bases = _gateways(redis_url, fleet)
    with stack:
        wait_for(lambda: all(_peers(b) == 1 for b in bases), what="gateways see each other")
        clients = [_client(b) for b in bases]
        for c in range(5):
            seen = _replicas_of_turns(clients, c)
            assert len(set(seen)) == 1, seen  # every turn on the first turn's replica


def test_short_conversations_through_one_gateway_keep_their_replica(
    sim_factory: Callable[..., tuple[Proc, str]]
) -> None:
    fleet = [sim_factory()[1] for _ in range(4)]
    # answers longer than the scrape interval (250 ms): a scrape falls within each turn, and
    # the next turn mostly comes before the next scrape
    proc, base = gateway_proc(config={
        "pools": {"p": {"replicas": fleet, "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}},
        "routing": {"policy": "cache_aware"},
    })
    with proc:
        clients = [_client(base)]
        moved = [seen for c in range(4)
                 if len(set(seen := _replicas_of_turns(clients, c, max_tokens=64))) > 1]
        assert not moved, moved  # every turn on its conversation's first turn's replica
