"""TPM admission reserves what a request may consume, as flow control charges it (`asked_tokens`:
the prompt plus ``n`` times ``max_tokens``, else `flow.expected_output_tokens`), and settles it
with the real usage: a real gateway on Redis, a simulated replica, the official openai client.

`x-ratelimit-remaining-tokens` on the answer is the bucket right after admission, so it shows
the reservation. Before, only the prompt was reserved: ``n=3, max_tokens=100`` left ~990 of 1000.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.support.gateway import acme_gateway, admin_client
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
    # beyond the replica's context: vLLM's (here the simulator's) 400 before any output
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=100_000)
    # the 100,000 tokens reserved never ran: only the prompt stays charged
    assert _remaining(client, max_tokens=1) >= TPM - 60


def test_an_embedding_reserves_its_prompt_only(client: openai.OpenAI) -> None:
    """No output to reserve, whatever its body carries: a ``max_tokens`` of 5000 on an
    embedding reserved 1000 (all of this TPM) and was refused with 429."""
    raw = client.embeddings.with_raw_response.create(
        model="llama", input="Hello " * 20, extra_body={"max_tokens": 5000, "n": 2})
    assert raw.parse().data
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) >= TPM - 40
