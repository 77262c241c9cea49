"""Tokens a tenant owes are owed until the bucket has refilled them, on Redis as in memory.

A request admitted on a positive balance may use more than the tenant's `tpm` (its reservation
is its `max_tokens`): the overshoot is owed, and the next requests get 429 with a `Retry-After`
until the budget is back above zero. The Redis bucket expired 61 s after its last admission
whatever it owed: 3,000 tokens used on a 600 TPM budget were answered `Retry-After: 241`, and a
request 63 s later was admitted on a full bucket (a client that paused a minute between big
requests got several times its TPM).

A real gateway on Redis, a simulated replica, the official openai client.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import openai
import pytest

from tests.support.gateway import acme_gateway, admin_client
from tests.support.procs import Proc

ADMIN = "tpm-debt-admin-token-0123456789"
TPM = 600
USED = 3000  # 2,400 tokens owed past the budget: four minutes of refill at 600 a minute


def _retry_after(client: openai.OpenAI) -> int:
    """The Retry-After of a small request, which the debt must refuse."""
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    return int(refused.value.response.headers["retry-after"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tokens_owed_past_a_minute_are_still_owed(
        sim_factory: Callable[..., tuple[Proc, str]], redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "50", "--max-model-len", "8192", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"tpm": TPM})
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
        used = client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=USED,
            extra_body={"ignore_eos": True}).usage
        assert used is not None and used.total_tokens >= USED
        first = _retry_after(client)
        assert first > 180, first  # (2,400 owed + 1) / 10 a second
        time.sleep(63)  # past the minute and a second the bucket lived
        # still owed: about a minute less to wait, not a full bucket
        later = _retry_after(client)
        assert first - 75 <= later <= first - 55, (first, later)
