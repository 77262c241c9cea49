"""A Redis restarted empty (no persistence, a failover to an empty replica) while a tenant runs
requests at its `max_concurrency`: the leases and buckets it held are gone. What the tenant
sees: a brief over-admission (its requests in flight no longer counted), never a 500, nor
counters stuck -- the requests in flight end without a trace in the new Redis, and from then
on the limit holds exactly as before (two streams at once, the third refused, none refused
once they end).

A real gateway, a real redis-server restarted on its port, simulated replicas (one whose
streams hang until the client leaves), the official openai client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import openai

from tests.support.gateway import AUTH_SECRET, admin_client, chat_status, gateway_proc, wait_for
from tests.support.procs import Proc, free_port, redis_proc

ADMIN = "limits-wipe-admin-token-0123456789"
LIMIT = 2


def _hanging(client: openai.OpenAI, stack: ExitStack) -> int:
    """Open a stream that hangs after its first tokens (closed with `stack`); its status."""
    try:
        stream = client.chat.completions.create(
            model="hang", messages=[{"role": "user", "content": "hi"}], max_tokens=50,
            stream=True)
    except openai.APIStatusError as exc:
        return exc.status_code
    stack.callback(stream.close)
    chunks: Iterator[Any] = iter(stream)
    next(chunks)
    return 200


def test_a_redis_restarted_empty_leaves_no_stuck_lease_and_no_500(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    _, hang = sim_factory("--time-scale", "50", "--hang-after-tokens", "2", model="h")
    port = free_port()
    config = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]},
                  "h": {"served_model": "h", "replicas": [hang]}},
        "models": {"llama": {"free": "p"}, "hang": {"free": "h"}},
        "tiers": {"free": {"limits": {"max_concurrency": LIMIT}}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    server, _ = redis_proc(port)
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with server, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        seen: list[int] = []
        with ExitStack() as held:
            assert [_hanging(client, held) for _ in range(LIMIT)] == [200] * LIMIT
            assert chat_status(client) == 429  # at its limit
            server.stop()
            server.start()  # empty: the leases of the two streams are gone
            # the gateway writes its state back (the key included) and answers again
            def answered() -> bool:
                seen.append(chat_status(client))
                return seen[-1] == 200

            wait_for(answered, timeout=30, what="requests answered after the restart")
        # the two streams have ended: nothing of theirs counts, nothing is stuck
        with ExitStack() as held:
            assert [_hanging(client, held) for _ in range(LIMIT)] == [200] * LIMIT
            assert chat_status(client) == 429  # the limit holds as before
        # (the gateway notices the streams' clients left a moment after they closed; a
        # lease it had not released would hold for its TTL, 30 s)
        wait_for(lambda: chat_status(client) == 200, timeout=10, what="the leases released")
        assert 500 not in seen, seen
