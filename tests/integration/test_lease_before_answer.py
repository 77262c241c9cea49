"""A tenant at its `max_concurrency` sending its next request the moment it has read an
answer is not refused for concurrency, even through another gateway.

A request's concurrency lease was released after its answer had gone out: a client reading
the answer from a gateway whose Redis is farther away (here 0.25 s each way: another zone)
and sending its next request through a gateway near Redis found the lease still held (429
"concurrent requests", 5 of 5 whole answers, streams and the gateway's own error answers
alike). The lease is released with its settle before a whole answer, a stream's last event
or the gateway's own error answer (a pool without a live replica: 503) goes out now.

Two real gateways on one Redis (one through a slow link), simulated replicas, the official
openai client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, chat_status, gateway_proc, wait_for
from tests.support.procs import Proc, free_port
from tests.support.slow_link import SlowLink

ADMIN = "lease-before-answer-admin-token-0123456789"
ROUNDS = 5
ONE_WAY_S = 0.25
Ask = Callable[[openai.OpenAI], int]


def _stream_status(client: openai.OpenAI) -> int:
    try:
        for _chunk in client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                stream=True):
            pass
        return 200
    except openai.APIStatusError as exc:
        return exc.status_code


@pytest.fixture
def two_gateways(sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc],
                 redis_url: str) -> Iterator[list[openai.OpenAI]]:
    """Clients of tenant `acme` (max_concurrency 1): of a gateway far from Redis, then of
    one near it. Model "llama" has a live replica, "dead" none."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]},
                  "d": {"served_model": "m", "replicas": [f"http://127.0.0.1:{free_port()}"]}},
        "models": {"llama": {"free": "p"}, "dead": {"free": "d"}},
        "tiers": {"free": {"limits": {"max_concurrency": 1}}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    with SlowLink(port, ONE_WAY_S) as link:
        # the far gateway's calls take 0.5 s and more: its timeout leaves room for that
        far, far_base = gateway_proc(
            config={**config, "tenancy": {"redis_timeout_s": 3.0}}, auth=True,
            env={**env, "KVGATE_REDIS_URL": f"redis://127.0.0.1:{link.port}/0"})
        near, near_base = gateway_proc(config=config, auth=True,
                                       env={**env, "KVGATE_REDIS_URL": redis_url})
        procs.append(near.start())
        procs.append(far.start())
        with admin_client(near_base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        clients = [openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
                   for base in (far_base, near_base)]
        wait_for(lambda: chat_status(clients[0]) == 200, timeout=20,
                 what="the far gateway to know the key")
        yield clients


def _next_requests(clients: list[openai.OpenAI], first: Ask) -> list[int]:
    """The statuses of the near gateway's requests, each sent as the far one answered."""
    statuses = []
    for _ in range(ROUNDS):
        first(clients[0])
        statuses.append(chat_status(clients[1]))
    return statuses


def test_after_a_whole_answer_the_next_request_finds_the_lease_released(
        two_gateways: list[openai.OpenAI]) -> None:
    assert _next_requests(two_gateways, chat_status) == [200] * ROUNDS


def test_after_a_stream_the_next_request_finds_the_lease_released(
        two_gateways: list[openai.OpenAI]) -> None:
    assert _next_requests(two_gateways, _stream_status) == [200] * ROUNDS


def test_after_an_error_answer_the_next_request_finds_the_lease_released(
        two_gateways: list[openai.OpenAI]) -> None:
    assert _next_requests(two_gateways, lambda c: chat_status(c, "dead")) == [200] * ROUNDS
