"""A gateway started while an address is throttled for failed admin authentications (at another
gateway on the same Redis) refuses that address from its first admin request on, a valid token
included. Two real `kvgate serve` processes, one real redis-server.

Before, the store's listener read the addresses throttled meanwhile only once someone listened
(`on_auth_throttled`, set when the admin app is built, after the listener had subscribed) and
its next wait for a message ended (up to a second): the new gateway's first admin requests, a
valid token's, were answered 200 meanwhile."""

from __future__ import annotations

import time

import httpx

from tests.support.gateway import AUTH_SECRET, gateway_proc
from tests.support.procs import Proc

ADMIN = "throttle-at-start-admin-token-0123456789"
CONFIG = {"pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
          "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}}


def _gateway(redis_url: str, *, ready: bool) -> tuple[Proc, str]:
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    return gateway_proc(config=CONFIG, env=env, auth=True, ready=ready)


def _client(base: str, token: str, address: str) -> httpx.Client:
    """An admin client connecting from `address` (a loopback address of its own: each
    round throttles a fresh one)."""
    return httpx.Client(base_url=f"{base}/admin", headers={"Authorization": f"Bearer {token}"},
                        transport=httpx.HTTPTransport(local_address=address), timeout=10)


def _first_admin_answer(base: str, address: str) -> int:
    """The status of the first admin request (a valid token) the gateway answers, past 503s
    (the throttled addresses not read yet: on a loaded machine the read outlasts one
    request's wait for it, and the request is refused, not let in unchecked)."""
    deadline = time.monotonic() + 30
    with _client(base, ADMIN, address) as admin:
        while time.monotonic() < deadline:
            try:
                status = admin.get("/tenants").status_code
            except httpx.TransportError:  # not listening yet
                time.sleep(0.01)
                continue
            if status != 503:
                return status
    raise AssertionError("the gateway never answered")


def test_a_gateway_started_meanwhile_refuses_a_throttled_address_at_once(
        redis_url: str) -> None:
    first, base = _gateway(redis_url, ready=False)  # (its replica is down: /healthz)
    with first:
        for n in range(2, 5):  # (a few rounds: the window was the start's first second)
            address = f"127.0.0.{n}"
            with _client(base, "not-the-admin-token-0123456789", address) as wrong:
                statuses = [wrong.get("/tenants").status_code for _ in range(11)]
            assert statuses[-1] == 429, statuses  # throttled: 10 failures, then refused
            late, late_base = _gateway(redis_url, ready=False)
            late.ready_url = None  # started, not waited for: its first answer is the test
            with late:
                assert _first_admin_answer(late_base, address) == 429
