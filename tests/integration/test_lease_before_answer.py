"""A tenant at its `max_concurrency` sending its next request the moment it has read an
answer is not refused for concurrency, even through another gateway.

A request's concurrency lease was released after its answer had gone out: a client reading
the answer from a gateway whose Redis is farther away (here 0.25 s each way: another zone)
and sending its next request through a gateway near Redis found the lease still held (429
"concurrent requests", 5 of 5 whole answers). The lease is released before a whole answer
goes out now (with its settle, one step).

Two real gateways on one Redis (one through a slow link), a simulated replica, the official
openai client.
"""

from __future__ import annotations

from collections.abc import Callable

import openai

from tests.support.gateway import acme_gateway, admin_client, chat_status, wait_for
from tests.support.procs import Proc
from tests.support.slow_link import SlowLink

ADMIN = "lease-before-answer-admin-token-0123456789"
ROUNDS = 5
ONE_WAY_S = 0.25


def test_the_next_request_through_another_gateway_finds_the_lease_released(
        sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc],
        redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    limits = {"max_concurrency": 1}
    with SlowLink(port, ONE_WAY_S) as link:
        # the far gateway's calls take 0.5 s and more: its timeout leaves room for that
        far, far_base = acme_gateway(sim, f"redis://127.0.0.1:{link.port}/0", ADMIN, limits,
                                     tenancy={"redis_timeout_s": 3.0})
        near, near_base = acme_gateway(sim, redis_url, ADMIN, limits)
        procs.append(near.start())
        procs.append(far.start())
        with admin_client(near_base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        clients = [openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
                   for base in (far_base, near_base)]
        wait_for(lambda: chat_status(clients[0]) == 200, timeout=20,
                 what="the far gateway to know the key")
        statuses = []
        for _ in range(ROUNDS):
            statuses.append(chat_status(clients[0]))  # answered by the far gateway ...
            statuses.append(chat_status(clients[1]))  # ... the next at once by the near one
        assert statuses == [200] * 2 * ROUNDS, statuses
