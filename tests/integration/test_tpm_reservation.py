"""TPM admission reserves what a request may consume, as flow control charges it (`asked_tokens`:
the prompt plus ``n`` times ``max_tokens``, else `flow.expected_output_tokens`), and settles it
with the real usage: a real gateway on Redis, a simulated replica, the official openai client.

`x-ratelimit-remaining-tokens` on a whole answer is the bucket after its settle (its usage, which
`ignore_eos` makes the reservation here). Before, only the prompt was reserved: ``n=3,
max_tokens=100`` left ~990 of 1000.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import openai
import orjson
import pytest

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, whole
from tests.support.gateway import (
    AUTH_SECRET,
    acme_gateway,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "tpm-reservation-admin-token-0123"
TPM = 1000


@pytest.fixture
def client(sim_factory: Callable[..., tuple[Proc, str]], redis_url: str) -> Iterator[openai.OpenAI]:
    _, sim = sim_factory("--time-scale", "50", "--max-model-len", "4096", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"tpm": TPM})
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def _remaining(client: openai.OpenAI, **kw: Any) -> int:
    raw = client.chat.completions.with_raw_response.create(
        model="llama", messages=[{"role": "user", "content": "Hello"}], **kw)
    raw.parse()
    return int(raw.headers["x-ratelimit-remaining-tokens"])


def test_n_choices_and_max_tokens_are_reserved_then_settled(client: openai.OpenAI) -> None:
    left = _remaining(client, n=3, max_tokens=100, extra_body={"ignore_eos": True})
    # 1000 - (prompt + 3 x 100): the three choices' output is reserved at admission
    assert TPM - 300 - 40 <= left <= TPM - 300, left
    # settled with the real usage (~3 x 100 + prompt): the next small request sees the same
    # debt, not the reservation twice, nor nothing
    after = _remaining(client, max_tokens=1)
    assert TPM - 300 - 80 <= after <= TPM - 300 + 40, after


def test_a_request_its_replica_refuses_is_charged_its_prompt_only(
        client: openai.OpenAI) -> None:
    for _ in range(10):
        # beyond the replica's context: vLLM's (here the simulator's) 400 before any output
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "x"}], max_tokens=100_000)
        # the 100,000 tokens reserved never ran: only the prompt stays charged, and settled
        # before the 400 went out (the next request, sent at once, was a 429 now and then)
        assert _remaining(client, max_tokens=1) >= TPM - 200


def test_an_embedding_reserves_its_prompt_only(client: openai.OpenAI) -> None:
    """No output to reserve, whatever its body carries: a ``max_tokens`` of 5000 (and ``n``
    2) on an embedding reserved 10,000 tokens, emptying this 1000 TPM bucket: the tenant's
    other requests got 429 until the embedding was settled."""
    raw = client.embeddings.with_raw_response.create(
        model="llama", input="Hello " * 20, extra_body={"max_tokens": 5000, "n": 2})
    assert raw.parse().data
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) >= TPM - 40


def test_a_request_retried_after_a_500_is_reserved_and_settled_once(
        sim_factory: Callable[..., tuple[Proc, str]], redis_url: str) -> None:
    """A replica answering vLLM's 500 for every request, another serving: the requests it
    failed are answered by the other, each reserved once and settled with the one usage that
    answered it; nothing stays in flight; the retry is in the metrics and the log."""
    _, bad = sim_factory("--time-scale", "50", "--error-rate", "1", model="m")
    _, good = sim_factory("--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [bad, good]}},
              "models": {"llama": {"free": "p"}}, "routing": {"policy": "round_robin"},
              "tiers": {"free": {"limits": {"tpm": TPM}}},
              "tenants": [{"id": "acme", "tier": "free"}]}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        used = 0
        for _ in range(2):  # round robin: one of them meets the failing replica first
            raw = client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "Hello"}], max_tokens=20,
                extra_body={"ignore_eos": True})
            answer = raw.parse()
            assert answer.usage is not None and raw.headers["x-kvgate-replica"].endswith(
                good.rsplit("/", 1)[1])
            used += answer.usage.total_tokens
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert sum(v for k, v in retries.items() if "status_500" in k) == 1, retries
        left = _remaining(client, max_tokens=1)
        # the two answers' usage and this one's reservation: no try charged twice
        assert TPM - used - 15 <= left <= TPM - used, (left, used)
        assert inflight(base) == 0
        retries = metric_values(base, "kvgate_upstream_retries_total")
        lines = [orjson.loads(line) for line in gw.output(None).splitlines()
                 if line.startswith("{")]
    assert any(r.get("msg") == "replica answered 500, trying one other" for r in lines)
    retried = [r for r in lines if r.get("msg") == "request" and r["attempts"] == 2]
    assert len(retried) == sum(retries.values()) >= 1, retries
    assert all(r["route"] == "retry" and r["status"] == 200 for r in retried), retried


def test_a_request_its_replica_fails_with_500_is_charged_its_prompt_only(
        sim_factory: Callable[..., tuple[Proc, str]], redis_url: str) -> None:
    """vLLM's 500 (an exception serving the request) is the answer: the client got no output,
    and the 3 x 100 tokens reserved for it stayed charged to its tenant's TPM."""
    _, sim = sim_factory("--time-scale", "50", "--error-rate", "1", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"tpm": TPM})
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "Hello"}], n=3,
                max_tokens=100)
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "Hello"}], max_tokens=1)
        # the second one's answer shows the bucket after the first was settled
        left = int(failed.value.response.headers["x-ratelimit-remaining-tokens"])
        assert left >= TPM - 40, left


def test_a_max_tokens_past_the_models_context_reserves_what_fits_in_it(
        redis_url: str) -> None:
    """``max_tokens`` 100,000 on a model of 512 tokens reserved 100,000 of the tenant's 2000
    TPM: while it ran, the tenant's next request was a 429. The replica can produce at most
    what fits beside the prompt in its ``max_model_len`` (its /v1/models card), and the
    reservation is capped there."""
    card = {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 512}]}
    with BadReplica("m") as replica:
        replica.pages[b"/v1/models"] = orjson.dumps(card)
        replica.rest = whole(CHAT_ANSWER)  # each answer waits for the gate
        gw, base = acme_gateway(replica.url, redis_url, ADMIN, {"tpm": 2000})
        with gw, admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                   timeout=30)
            wait_for(lambda: (client.models.retrieve("llama").model_extra or {}).get(
                "max_model_len") == 512, what="the gateway learns the context length")
            statuses: list[int] = []

            def ask(max_tokens: int) -> None:
                statuses.append(chat_status_of(client, max_tokens))

            first = threading.Thread(target=ask, args=(100_000,))
            first.start()
            wait_for(lambda: replica.posts == 1, what="the first request at the replica")
            second = threading.Thread(target=ask, args=(10,))
            second.start()
            wait_for(lambda: replica.posts == 2 or bool(statuses), what="the second request")
            replica.gate.set()
            first.join(10)
            second.join(10)
            assert statuses == [200, 200]


def chat_status_of(client: openai.OpenAI, max_tokens: int) -> int:
    try:
        return client.chat.completions.with_raw_response.create(
            model="llama", messages=[{"role": "user", "content": "hi"}],
            max_tokens=max_tokens).status_code
    except openai.APIStatusError as exc:
        return exc.status_code
