"""A request that ends without its usage is settled at what it used, not at its reservation.

TPM admission reserves the prompt plus ``max_tokens`` up front (`asked_tokens`). A stream the
client cancels (a chat UI's stop button), one the gateway cuts (a replica that stalls), and a
whole answer whose client leaves end without the usage chunk: they were left charged their
whole reservation. Three streams stopped after their first event with ``max_tokens`` 400 used
a 1,000 TPM budget for about 70 s (the tenant got 429 meanwhile). Each is now charged its
prompt and the output streamed to the client so far, estimated as the gateway estimates a
prompt (`routing.tokens`). Real gateways on the in-memory store and on a real redis-server
(and the picker behind a real Envoy), a simulated replica, the official openai client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.edges import running_edge
from tests.support.gateway import (
    AUTH_SECRET,
    FAST_HEALTH,
    admin_client,
    gateway_proc,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "tpm-cancel-admin-token-0123456789"
TPM = 1000
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


def _gateway(sim: str, redis_url: str | None, **upstream: Any) -> tuple[Proc, str]:
    config: dict[str, Any] = {
        "health": {**FAST_HEALTH, "failure_threshold": 10},  # stalls must not eject it
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"tpm": TPM}}},
        "tenants": [{"id": "acme", "tier": "free"}],
        **({"upstream": upstream} if upstream else {}),
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url or ""}
    return gateway_proc(config=config, env=env, auth=True)


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[str | None]:
    if request.param == "memory":
        yield None
    else:
        yield request.getfixturevalue("redis_url")


def _key(base: str) -> str:
    with admin_client(base, ADMIN) as admin:
        key: str = admin.post("/tenants/acme/keys").json()["key"]
    return key


def _client(base: str, key: str, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=timeout)


def _remaining(client: openai.OpenAI) -> int:
    """The bucket after one small request's admission; -1 while the tenant gets 429."""
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="llama", messages=PROMPT, max_tokens=1)
    except openai.RateLimitError:
        return -1
    raw.parse()
    return int(raw.headers["x-ratelimit-remaining-tokens"])


def _settled(client: openai.OpenAI, at_least: int) -> None:
    """The bucket is back to `at_least` within seconds (the reservation alone refills only
    at TPM/60 a second: 70 s for the streams below)."""
    seen: list[int] = []

    def back() -> bool:
        seen.append(_remaining(client))
        return seen[-1] >= at_least

    try:
        wait_for(back, timeout=5, what="the bucket settled")
    except AssertionError:
        raise AssertionError(f"remaining tokens {seen[-3:]}, wanted >= {at_least}") from None


def test_streams_stopped_after_their_first_event_are_charged_what_they_used(
        sim_factory: Callable[..., tuple[Proc, str]], store: str | None) -> None:
    # each stream sends a few tokens, then waits (a long generation) until its client leaves
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "5", model="m")
    gw, base = _gateway(sim, store)
    with gw:
        client = _client(base, _key(base))
        for _ in range(3):
            stream = client.chat.completions.create(
                model="llama", messages=PROMPT, max_tokens=400, stream=True)
            next(iter(stream))
            stream.close()  # the stop button
        # 3 x (prompt + a few streamed tokens), not 3 x 402: about 1,000 - 3 x 10
        _settled(client, TPM - 60)


def test_a_stream_the_gateway_cuts_is_charged_what_reached_the_client(
        sim_factory: Callable[..., tuple[Proc, str]], store: str | None) -> None:
    """A replica that stops sending mid-answer: the gateway ends the stream with an error
    event after `upstream.idle_timeout_s`, and no usage ever comes."""
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "5", model="m")
    gw, base = _gateway(sim, store, idle_timeout_s=0.5)
    with gw:
        client = _client(base, _key(base))
        for _ in range(3):
            stream = client.chat.completions.create(
                model="llama", messages=PROMPT, max_tokens=400, stream=True)
            with pytest.raises(openai.APIError):
                for _event in stream:
                    pass
        _settled(client, TPM - 60)


def test_a_whole_answer_whose_client_left_is_charged_its_prompt(
        sim_factory: Callable[..., tuple[Proc, str]], store: str | None) -> None:
    """Nothing reached the client: it is charged its prompt (the replica drops the request
    when the gateway closes its connection)."""
    _, sim = sim_factory("--time-scale", "50", "--latency-ms", "3000", model="m")
    gw, base = _gateway(sim, store)
    with gw:
        key = _key(base)
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{base}/v1/chat/completions", timeout=0.3,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "llama", "messages": PROMPT, "max_tokens": 400})
        _settled(_client(base, key, timeout=10), TPM - 60)


def test_streams_stopped_through_envoy_are_charged_what_they_used(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    """The picker edge settles as the HTTP edge does (`ProxiedRequest.settle_tokens`), with
    the output it saw relayed (`AnswerSide._event`)."""
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "5", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"free": "p"}}, "tiers": {"free": {"limits": {"tpm": TPM}}},
              "tenants": [{"id": "acme", "tier": "free"}]}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    with running_edge("envoy", config=config, auth=True, env=env) as (base, admin):
        client = _client(base, _key(admin))
        for _ in range(3):
            stream = client.chat.completions.create(
                model="llama", messages=PROMPT, max_tokens=400, stream=True)
            next(iter(stream))
            stream.close()
        _settled(client, TPM - 60)
