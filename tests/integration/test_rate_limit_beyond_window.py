"""A 429 whose wait is longer than a minute is not retried by the openai SDK: it carries
``x-should-retry: false``, so the client has the refusal and its ``Retry-After`` at once.

A tenant with 600 TPM whose request of ~1,500 tokens was admitted (its budget was above zero)
owes ~900 tokens: its next request is refused for ~90 s. The SDK (two retries by default)
slept that ``Retry-After`` in the call, twice, to be refused again (an older SDK, honouring
at most 60 s, retried after a second of its own back-off, in vain). A real gateway on Redis,
a simulated replica, the official openai client with its default retries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import acme_gateway, admin_client, request_statuses
from tests.support.procs import Proc

ADMIN = "beyond-window-admin-token-0123456789"
TPM = 600
PROMPT = "word " * 1200  # ~1,500 tokens: ~900 owed, a ~90 s wait (between 60 and 120)


def test_a_wait_longer_than_the_window_is_not_retried_by_the_sdk(
        sim_factory: Callable[..., tuple[Proc, str]], redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"tpm": TPM})
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        first = httpx.post(f"{base}/v1/chat/completions",
                           headers={"authorization": f"Bearer {key}"}, timeout=30,
                           json={"model": "llama", "max_tokens": 2,
                                 "messages": [{"role": "user", "content": PROMPT}]})
        assert first.status_code == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=30)  # 2 retries
        caught: list[BaseException] = []

        def ask() -> None:
            try:
                client.chat.completions.create(
                    model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            except openai.APIStatusError as exc:
                caught.append(exc)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        asking.join(45)  # well under the wait the SDK would sleep before a retry
        assert not asking.is_alive(), "the SDK is sleeping to retry a 429 that cannot pass"
        assert len(caught) == 1 and isinstance(caught[0], openai.RateLimitError), caught
        resp = caught[0].response
        assert resp.headers["x-should-retry"] == "false"
        assert 60 < int(resp.headers["retry-after"]) <= 120, resp.headers
        assert request_statuses(base).get("429") == 1  # asked once, not three times
