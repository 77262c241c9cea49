"""A request refused at its tenant's concurrency limit is told to come back when one of the
tenant's requests is likely over (their hold time so far, less the age of the oldest one in
flight), not after 1 s whatever they are: the openai SDK, whose two retries slept the 1 s
each, got its 429 two seconds into a call while the tenant's streams ran for several
seconds; now its retries find the slot free.

One real gateway (in-memory limits; and the shared ones on a real redis-server) before one
simulated replica decoding slowly (`--slowdown`), the tenant `acme` at ``max_concurrency:
1``, streams of ``TOKENS`` tokens (``ignore_eos``). The official openai client.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.support.gateway import acme_gateway, admin_client, inflight, wait_for
from tests.support.procs import Proc

ADMIN = "ratelimit3-conc-admin-token-0123456789"
TOKENS = 30
ASK: dict[str, Any] = {"model": "llama", "max_tokens": TOKENS, "extra_body": {"ignore_eos": True},
                       "messages": [{"role": "user", "content": "hi"}]}


def _stream(client: openai.OpenAI) -> float:
    """One stream read to its end; how long it took (s)."""
    t0 = time.monotonic()
    for _ in client.chat.completions.create(**ASK, stream=True):
        pass
    return time.monotonic() - t0


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_concurrency_refusal_says_when_a_slot_frees(
    store: str, sim_factory: Callable[..., tuple[Proc, str]], request: pytest.FixtureRequest,
) -> None:
    _, sim = sim_factory("--time-scale", "1", "--slowdown", "20", model="m")
    redis_url = request.getfixturevalue("redis_url") if store == "redis" else ""
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"max_concurrency": 1})
    with gw:
        with admin_client(base, ADMIN) as admin:
            key = str(admin.post("/tenants/acme/keys").json()["key"])
        bare = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
        took = _stream(bare)  # its hold time is known from now on
        assert took >= 3, f"the replica decodes too fast for this test ({took:.1f} s)"
        first = bare.chat.completions.create(**ASK, stream=True)
        running = threading.Thread(target=lambda: [None for _ in first], daemon=True)
        next(iter(first))  # it holds the tenant's only slot
        running.start()
        with pytest.raises(openai.RateLimitError) as err:
            bare.chat.completions.create(**ASK)
        said = err.value.response.headers
        # about what is left of the running stream's time: more than the 1 s it said before
        assert 2 <= int(said["retry-after"]) <= math.ceil(took) + 1, dict(said)
        assert int(said["retry-after-ms"]) > 1000
        # the SDK with its default retries (two) gets in once the stream is over
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=120)
        answer = sdk.chat.completions.create(**ASK)
        assert answer.usage is not None and answer.usage.completion_tokens == TOKENS
        running.join(60)
        wait_for(lambda: inflight(base) == 0, 20, "nothing in flight")
