"""The x-ratelimit-* headers of a whole answer show the tenant's token bucket after the
request, as OpenAI's do: its reservation (prompt + ``max_tokens``) replaced by what it used.
They showed the bucket right after admission: ``max_tokens`` 500 for an answer of 2 tokens
said 500 tokens fewer were left than were. At both edges: the HTTP edge settles before the
answer goes out, the picker behind Envoy shows the settle its exchange's close makes.

One loopback replica answering a whole chat completion of 2 tokens (or a 400), each edge with
authentication and the tenant `acme` limited to `TPM`, the official openai client.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import orjson
import pytest

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, whole
from tests.support.edges import running_edges
from tests.support.gateway import AUTH_SECRET, admin_client

ADMIN = "ratelimit-headers-admin-token-0123"
TPM = 5000
EDGES = ["http", "envoy"]
REFUSED = orjson.dumps({"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                  "param": "max_tokens", "code": 400}})


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    """Both edges over one replica; the admin API of each (the picker's on its HTTP port)."""
    config = {"pools": {"p": {"served_model": "m"}}, "models": {"llama": {"free": "p"}},
              "tiers": {"free": {"limits": {"tpm": TPM}}}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    with BadReplica("m", answer=whole(CHAT_ANSWER)) as replica:
        config["pools"]["p"]["replicas"] = [replica.url]  # type: ignore[index]
        with running_edges(config=config, env=env, auth=True) as edges:
            yield replica, {**{name: edge.base for name, edge in edges.items()},
                            **{f"{name}-admin": edge.admin for name, edge in edges.items()}}


def _client(every: dict[str, str], edge: str, tenant: str) -> openai.OpenAI:
    """A client with the key of a new tenant (its bucket full)."""
    with admin_client(every[f"{edge}-admin"], ADMIN) as admin:
        assert admin.post("/tenants", json={"id": tenant, "tier": "free"}).status_code == 201
        key = admin.post(f"/tenants/{tenant}/keys").json()["key"]
    return openai.OpenAI(base_url=f"{every[edge]}/v1", api_key=key, max_retries=0, timeout=15)


@pytest.mark.parametrize("edge", EDGES)
def test_a_whole_answers_remaining_tokens_are_after_its_usage(
    edges: tuple[BadReplica, dict[str, str]], edge: str,
) -> None:
    replica, every = edges
    replica.answer = whole(CHAT_ANSWER)
    client = _client(every, edge, f"used-{edge}")
    raw = client.chat.completions.with_raw_response.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=500)
    usage = raw.parse().usage
    assert usage is not None and usage.total_tokens == 2
    assert raw.headers["x-ratelimit-limit-tokens"] == str(TPM)
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(TPM - 2)


@pytest.mark.parametrize("edge", EDGES)
def test_a_refused_requests_remaining_tokens_are_after_its_prompt(
    edges: tuple[BadReplica, dict[str, str]], edge: str,
) -> None:
    """A replica's 400: only the prompt estimate stays charged, and the header says so."""
    replica, every = edges
    replica.answer = whole(REFUSED, status=400)
    client = _client(every, edge, f"refused-{edge}")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3000)
    left = int(err.value.response.headers["x-ratelimit-remaining-tokens"])
    assert TPM - 20 <= left < TPM, left
