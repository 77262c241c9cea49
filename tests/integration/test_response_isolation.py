"""A follow-up's ``previous_response_id`` reaches a replica only as its tenant's own response,
however the gateway that gets it knows (or cannot know) the id.

vLLM's response store is keyed by id alone: sent on to the replica holding it, a follow-up
naming another tenant's id continues that tenant's conversation. An id a gateway did not
relay and could not check (no Redis, Redis down) was sent on as unknown: with one replica it
always landed there, 200 with the other tenant's context. Now an id found nowhere is a 404, as
``GET /v1/responses/{id}`` answers it, and one Redis did not answer for a 503 to retry (GET
too: its 404 told the owner its response was gone). Ownership is the tenant's incarnation:
a tenant deleted and created again under its id reached its predecessor's responses.

Real gateways (with authentication; on Redis or alone), a real simulator keeping responses,
a real redis-server, the official openai client.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc, redis_proc

ADMIN = "response-isolation-admin-token-0123456789"
SimFactory = Callable[..., tuple[Proc, str]]


def _config(sim: str) -> dict[str, Any]:
    return {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
            "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
            "tenants": [{"id": "acme", "tier": "free"}, {"id": "evil", "tier": "free"}]}


def _gateway(stack: ExitStack, sim: str, redis: str | None) -> str:
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           **({"KVGATE_REDIS_URL": redis} if redis else {})}
    proc, base = gateway_proc(config=_config(sim), env=env, auth=True)
    stack.enter_context(proc)
    return base


def _client(base: str, tenant: str) -> openai.OpenAI:
    with admin_client(base, ADMIN) as admin:
        made = admin.post(f"/tenants/{tenant}/keys")
        assert made.status_code == 201, made.text
        key = made.json()["key"]
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def _follow(client: openai.OpenAI, rid: str) -> int:
    try:
        return client.responses.with_raw_response.create(
            model="llama", input="And what did I say?", max_output_tokens=4,
            previous_response_id=rid).status_code
    except openai.APIStatusError as exc:
        return exc.status_code


def _retrieve(client: openai.OpenAI, rid: str) -> int:
    try:
        return client.responses.with_raw_response.retrieve(rid).status_code
    except openai.APIStatusError as exc:
        return exc.status_code


def test_an_id_no_gateway_can_check_is_a_404_not_sent_on(sim_factory: SimFactory) -> None:
    """Two gateways without Redis: B never relayed A's response and cannot know whose it is."""
    _, sim = sim_factory("--time-scale", "50", "--enable-store", model="m")
    with ExitStack() as stack:
        a, b = _gateway(stack, sim, None), _gateway(stack, sim, None)
        made = _client(a, "acme").responses.create(
            model="llama", input="My secret is 42.", max_output_tokens=4)
        evil = _client(b, "evil")
        assert _follow(evil, made.id) == 404
        assert _retrieve(evil, made.id) == 404  # as GET answered it already
        assert _follow(_client(a, "evil"), made.id) == 404  # known there: another's
        assert _follow(_client(a, "acme"), made.id) == 200  # its own, where it is known


def test_a_lookup_redis_does_not_answer_is_a_503_to_retry(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", "--enable-store", model="m")
    redis, url = redis_proc()
    with ExitStack() as stack:
        stack.enter_context(redis)
        a, b = _gateway(stack, sim, url), _gateway(stack, sim, url)
        acme_a, acme_b, evil_b = _client(a, "acme"), _client(b, "acme"), _client(b, "evil")
        made = acme_a.responses.create(model="llama", input="My secret is 42.",
                                       max_output_tokens=4)
        other = acme_a.responses.create(model="llama", input="Hello", max_output_tokens=4)
        assert _follow(evil_b, made.id) == 404  # found in Redis: another tenant's
        assert _follow(acme_b, made.id) == 200  # found in Redis: its own
        assert _follow(acme_b, "resp_nobody_made_this") == 404  # found nowhere
        redis.stop()
        for client in (evil_b, acme_b):
            with pytest.raises(openai.APIStatusError) as caught:
                client.responses.create(model="llama", input="And?", max_output_tokens=4,
                                        previous_response_id=other.id)
            resp = caught.value.response
            assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1
            assert resp.json()["error"]["type"] == "ServiceUnavailableError"
            assert _retrieve(client, other.id) == 503  # was a 404: "your response is gone"


def test_a_tenant_made_again_does_not_reach_its_predecessors_responses(
        sim_factory: SimFactory, redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "50", "--enable-store", model="m")
    with ExitStack() as stack:
        base = _gateway(stack, sim, redis_url)
        before = _client(base, "acme")
        made = before.responses.create(model="llama", input="My secret is 42.",
                                       max_output_tokens=4)
        assert _follow(before, made.id) == 200
        with admin_client(base, ADMIN) as admin:
            assert admin.delete("/tenants/acme").status_code in (200, 204)
            assert admin.post("/tenants", json={"id": "acme", "tier": "free"}).status_code == 201
        after = _client(base, "acme")
        assert _follow(after, made.id) == 404
        assert _retrieve(after, made.id) == 404
        mine = after.responses.create(model="llama", input="Hi", max_output_tokens=4)
        assert _follow(after, mine.id) == 200
