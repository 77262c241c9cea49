"""A request flow control's queue refuses (a 503 at a full queue, a 429 past its longest wait)
was never served: its request and tokens go back to its tenant's buckets, and its
x-ratelimit-remaining-* say so, as OpenAI's do (remaining after this request; one refused
consumed nothing). They showed the buckets right after its admission: one request fewer than
was left (``remaining-requests: 0`` with a request left), and its whole reservation fewer
tokens.

Both edges (`kvgate serve`; the picker behind a real Envoy), one simulated replica whose
streams hang after a few tokens, ``flow.max_inflight: 1`` and ``max_queue: 1``: one stream
fills the pool, one request the queue, the third is refused. The tenant's tier allows
``RPM`` requests a minute (refilling one per 20 s, so the test's own seconds do not refill
one) and ``TPM`` tokens. The official openai client.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.support.edges import running_edge
from tests.support.gateway import AUTH_SECRET, admin_client, metric_values, wait_for
from tests.support.procs import Proc

ADMIN = "ratelimit3-shed-admin-token-0123456789"
RPM, TPM, MAX_TOKENS = 3, 100_000, 2_000


def _config(sim: str) -> dict[str, Any]:
    return {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
            "models": {"llama": {"free": "p"}},
            "tiers": {"free": {"limits": {"rpm": RPM, "tpm": TPM}, "flow": {"max_wait_s": 60}}},
            "tenants": [{"id": "t", "tier": "free"}],
            "flow": {"enabled": True, "max_inflight": 1, "max_queue": 1}}


@pytest.fixture(params=["serve", "envoy"])
def edge(request: pytest.FixtureRequest,
         sim_factory: Callable[..., tuple[Proc, str]]) -> Iterator[tuple[str, str]]:
    """(the base clients call, the base with /metrics and the admin API)."""
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "3", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    with running_edge(request.param, config=_config(sim), env=env, auth=True) as edge:
        yield edge


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def _quietly(client: openai.OpenAI, ask: dict[str, Any]) -> None:
    """A request whose answer the test does not wait for (cut when the edge stops)."""
    with contextlib.suppress(openai.APIError):
        client.chat.completions.create(**ask)


def test_a_shed_requests_remaining_counts_what_it_gave_back(edge: tuple[str, str]) -> None:
    base, admin_base = edge
    with admin_client(admin_base, ADMIN) as admin:
        key = str(admin.post("/tenants/t/keys").json()["key"])
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    ask: dict[str, Any] = {"model": "llama", "max_tokens": MAX_TOKENS,
                           "messages": [{"role": "user", "content": "hi"}]}
    filler = client.chat.completions.create(**ask, stream=True)
    next(iter(filler))  # it runs, and hangs: the pool is full (RPM left: 2)
    queued = threading.Thread(target=_quietly, args=(client, ask), daemon=True)
    queued.start()  # (RPM left: 1)
    wait_for(lambda: _depth(admin_base) == 1, 20, "the queue to fill")
    with pytest.raises(openai.APIStatusError) as err:  # admitted (RPM left: 0), then refused
        client.chat.completions.create(**ask)
    refused = err.value.response
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_shed"
    # given back: one request left, not 0 (the bucket refills one every 20 s)
    assert int(refused.headers["x-ratelimit-remaining-requests"]) >= 1
    # the two requests holding theirs: at most their reservations spent, not three
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) > TPM - 3 * MAX_TOKENS
    filler.close()  # (the queued request goes, and hangs in turn: the gateway's stop ends it)
