"""The Retry-After of an address throttled through the shared (Redis) failed-authentication
budget is the shared budget's, at a gateway of several workers too.

Each worker of a gateway of two holds half its budget, refilled at half the rate
(`AuthGuard.share_of`); a worker that took in the shared level (`AuthGuard.adopt`) refilled
it at its half rate: with the budget spent through another gateway, the two-worker gateway
answered ``Retry-After: 12`` where the one-worker gateway answered 6 (the shared budget
refills a failure every 6 s), and kept refusing the address, valid token included, for those
12 s after the other gateway admitted it again.

Two real gateways (one of one worker, one of two) on one real Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, wait_for
from tests.support.procs import Proc

ADMIN = "shared-retry-admin-token-0123456789"
WRONG = "wrong-token-" + "z" * 20


def test_a_throttled_address_is_told_the_shared_budgets_refill_by_every_gateway(
        sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc],
        redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    bases = []
    for workers in (1, 2):
        config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
                  "models": {"llama": {"default": "p"}}, "server": {"workers": workers}}
        gw, base = gateway_proc(config=config, env=env, auth=True)
        procs.append(gw.start())
        bases.append(base)
    one, two = bases
    with admin_client(one, WRONG) as wrong, admin_client(one, ADMIN) as at_one:
        statuses = [wrong.get("/tenants").status_code for _ in range(11)]
        assert statuses == [401] * 10 + [429], statuses
        refused = at_one.get("/tenants")
        assert refused.status_code == 429
        shared = int(refused.headers["retry-after"])

    def retry_at_two() -> list[int]:
        """Retry-After of both workers (each request on a connection of its own)."""
        waits = []
        for _ in range(6):
            with admin_client(two, ADMIN) as admin:
                answer = admin.get("/tenants")
                if answer.status_code != 429:
                    return []
                waits.append(int(answer.headers["retry-after"]))
        return waits

    wait_for(lambda: bool(retry_at_two()), timeout=20,
             what="the two-worker gateway to throttle the address")
    waits = retry_at_two()
    assert waits and max(waits) <= shared, (waits, shared)
    # once the shared budget has refilled a failure, both gateways admit a valid token
    time.sleep(shared)
    with admin_client(one, ADMIN) as at_one:
        wait_for(lambda: at_one.get("/tenants").status_code == 200, timeout=5,
                 what="the one-worker gateway to admit the address again")
    def admitted_at_two() -> bool:
        """Each of 6 requests on a connection of its own (both workers, most likely) a 200."""
        for _ in range(6):
            with admin_client(two, ADMIN) as admin:
                if admin.get("/tenants").status_code != 200:
                    return False
        return True

    wait_for(admitted_at_two, timeout=3,
             what="the two-worker gateway to admit the address again")


def test_a_gateway_started_after_the_throttle_refuses_the_address_too(
        sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc],
        redis_url: str) -> None:
    """The failure that throttles an address is told to the gateways listening then; one
    started after (a rolling deploy, a pod added) knew nothing of it and checked the
    address's token: a valid one was let in (200) while the address was refused everywhere
    else. It reads the addresses throttled now when it subscribes."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}}}
    first, base = gateway_proc(config=config, env=env, auth=True)
    procs.append(first.start())
    with admin_client(base, WRONG) as wrong:
        statuses = [wrong.get("/tenants").status_code for _ in range(11)]
        assert statuses == [401] * 10 + [429], statuses
    late, late_base = gateway_proc(config=config, env=env, auth=True)
    procs.append(late.start())
    with admin_client(late_base, ADMIN) as admin:
        wait_for(lambda: admin.get("/tenants").status_code == 429, timeout=5,
                 what="the gateway started after the throttle to refuse the address")
        refused = admin.get("/tenants")
        assert refused.status_code == 429, refused.text
        assert 1 <= int(refused.headers["retry-after"]) <= 6
