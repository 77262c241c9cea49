"""The failed-authentication budget of the admin API is one for every gateway on a Redis.

Each gateway counted an address's failures alone: with two gateways behind one address (a load
balancer's round robin, or an attacker picking them in turn) an address had twice the guesses
(10 at each: the second gateway still answered 401, checking every token). With Redis the
failures are counted there too, and the failure that throttles an address is told to every
gateway: the budget spent at one gateway is spent at all (429 with Retry-After, valid tokens
included, as at the gateway that counted them).

Two real gateways on one real Redis, tokens sent as an operator's HTTP client sends them.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.support.gateway import admin_client, shared_gateways, wait_for
from tests.support.procs import Proc

ADMIN = "shared-guard-admin-token-0123456789"
WRONG = "wrong-token-" + "y" * 20


def test_failures_at_one_gateway_throttle_the_address_at_the_other(
        sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc],
        redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}}}
    first, second = shared_gateways(procs, redis_url, ADMIN, config)
    with admin_client(first, WRONG) as at_first, admin_client(second, WRONG) as at_second, \
            admin_client(second, ADMIN) as admin:
        assert admin.get("/tenants").status_code == 200
        statuses = [at_first.get("/tenants").status_code for _ in range(11)]
        assert statuses == [401] * 10 + [429], statuses
        # told to the second gateway as the failure was counted (Redis pub/sub): the
        # address is refused there too, a valid token included
        wait_for(lambda: admin.get("/tenants").status_code == 429, timeout=20,
                 what="the second gateway to throttle the address")
        refused = at_second.get("/tenants")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert int(refused.headers["retry-after"]) >= 1
