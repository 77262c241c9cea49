"""Flow control's fair share keeps what a request used, not what it asked for. A chat UI's stop
button ends streams after their first event: each was charged its prompt plus ``max_tokens``
at its send and kept the whole charge, so its tenant looked, to the fair-share order and the
share cap, like one that had taken most of the pool lately (3 streams of ``max_tokens`` 400:
about 1,200 tokens served against another tenant's 30 for three short answers). A request
that ends without usage now keeps its prompt and the output relayed so far
(`ProxiedRequest.spent_tokens`). Both edges (`kvgate serve`; the picker behind a real Envoy),
a simulated replica whose streams hang after a few tokens, the official openai client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.edges import running_edge
from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "flow-cancel-admin-token-0123456789"
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
ASKED = 400


def _config(sim: str) -> dict[str, Any]:
    return {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
            "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
            "tenants": [{"id": "stopper", "tier": "free"}, {"id": "steady", "tier": "free"}],
            "flow": {"enabled": True}}


@pytest.fixture(params=["serve", "envoy"])
def edge(request: pytest.FixtureRequest,
         sim_factory: Callable[..., tuple[Proc, str]]) -> Iterator[tuple[str, str]]:
    """(the base clients call, the base with /metrics and the admin API)."""
    # each stream sends a few tokens, then waits until its client leaves
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "5", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    with running_edge(request.param, config=_config(sim), env=env, auth=True) as edge:
        yield edge


def _client(base: str, admin_base: str, tenant: str) -> openai.OpenAI:
    with admin_client(admin_base, ADMIN) as admin:
        key = str(admin.post(f"/tenants/{tenant}/keys").json()["key"])
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def _served(admin_base: str, tenant: str) -> float:
    return sum(v for k, v in metric_values(admin_base, "kvgate_flow_served_tokens_total").items()
               if f'tenant="{tenant}"' in k)


def test_streams_stopped_after_their_first_event_keep_what_they_used(
        edge: tuple[str, str]) -> None:
    base, admin_base = edge
    stopper = _client(base, admin_base, "stopper")
    steady = _client(base, admin_base, "steady")
    for _ in range(3):
        stream = stopper.chat.completions.create(
            model="llama", messages=PROMPT, max_tokens=ASKED, stream=True)
        next(iter(stream))
        stream.close()
        answer = steady.chat.completions.create(model="llama", messages=PROMPT, max_tokens=4)
        assert answer.usage is not None and answer.usage.completion_tokens == 4
    wait_for(lambda: inflight(admin_base) == 0 and _served(admin_base, "stopper") > 0, 10,
             "the stopped streams to end")
    stopped, answered = _served(admin_base, "stopper"), _served(admin_base, "steady")
    assert 0 < answered < 3 * 20, answered
    assert stopped <= 2 * answered, (stopped, answered)  # it was 3 x (prompt + 400)
    if base != admin_base:
        return  # (the picker has no route explain)
    with admin_client(admin_base, ADMIN) as admin:
        shares = {t: admin.post("/route/explain", json={"tenant": t, "request": {
            "model": "llama", "messages": PROMPT, "max_tokens": 4}}).json()["flow"]
            for t in ("stopper", "steady")}
    # what each sent lately, as the share cap sees it: the stopper no longer looks a hog
    assert shares["stopper"]["recent_share"] < 0.7, shares
