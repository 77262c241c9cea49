"""Conventions of clients other than the OpenAI SDK: the key in Azure's `api-key` header or in
`x-api-key`, a request with two different keys, a route written with a trailing slash, and
`/v1/embeddings` on a model whose vLLM has no such route. A real gateway with authentication
on, a simulated vLLM replica (or a scripted one), the official openai client, over loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.tenancy.resolver import INVALID_KEY
from tests.support.bad_replica import BadReplica, whole
from tests.support.gateway import AUTH_SECRET, GatewayProc, admin_client, gateway_proc, inflight
from tests.support.procs import sim_proc

ADMIN = "client-conventions-admin-0123456789"
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _auth_gateway(url: str) -> tuple[GatewayProc, str]:
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}},
              "tenants": [{"id": "acme", "tier": "default"}]}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    return gateway_proc(config=config, env=env, auth=True)


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, str]]:
    """(gateway base URL, an API key of tenant `acme`)."""
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    with sim:
        proc, base = _auth_gateway(url)
        with proc, admin_client(base, ADMIN) as admin:
            yield base, admin.post("/tenants/acme/keys").json()["key"]


@pytest.mark.parametrize("header", ["api-key", "x-api-key"])
def test_the_key_in_an_api_key_header_authenticates(gw: tuple[str, str], header: str) -> None:
    """Azure OpenAI's SDKs send the bare key in `api-key`, other providers' clients in
    `x-api-key`: kvgate reads them as it reads `Authorization: Bearer`."""
    base, key = gw
    with httpx.Client(base_url=base, headers={header: key}, timeout=30) as c:
        chat = c.post("/v1/chat/completions", json=CHAT)
        models = c.get("/v1/models")
    assert chat.status_code == 200, chat.text
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "llama"
    wrong = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={header: "kvg-nope"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["message"] == INVALID_KEY


@pytest.mark.parametrize("headers", [
    [("Authorization", "Bearer {key}"), ("Authorization", "Bearer kvg-other")],
    [("Authorization", "Bearer kvg-other"), ("Authorization", "Bearer {key}")],
    [("api-key", "{key}"), ("x-api-key", "kvg-other")],
], ids=["good-first", "good-last", "api-key-and-x-api-key"])
def test_two_different_keys_are_refused_whichever_comes_first(
    gw: tuple[str, str], headers: list[tuple[str, str]],
) -> None:
    """Which of two keys a proxy in front checked cannot be known (vLLM reads the first
    Authorization): a 401 that says so, not a request served under one of them."""
    base, key = gw
    sent = [(name, value.format(key=key)) for name, value in headers]
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        r = httpx.request(method, f"{base}{path}", json=CHAT if method == "POST" else None,
                          headers=sent, timeout=30)
        assert r.status_code == 401, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "AuthenticationError"
        assert "more than one API key" in error["message"]
        assert key not in r.text
    same = [("Authorization", f"Bearer {key}"), ("Authorization", f"bearer {key}"),
            ("x-api-key", key)]
    # Authorization wins over a bare key (a client may carry another provider's beside it)
    beside = [("x-api-key", "another-providers-key"), ("Authorization", f"Bearer {key}")]
    for sent in (same, beside):
        assert httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=sent,
                          timeout=30).status_code == 200


def test_the_azure_client_is_told_which_client_to_use(gw: tuple[str, str]) -> None:
    """The AzureOpenAI client sends its key in `api-key` (read) to Azure's deployment paths
    (not served): its 404 says what to use instead of only "Unknown path"."""
    base, key = gw
    version = "2024-10-21"
    clients = [openai.AzureOpenAI(api_key=key, api_version=version, max_retries=0,
                                  base_url=f"{base}/v1"),
               openai.AzureOpenAI(api_key=key, api_version=version, max_retries=0,
                                  azure_endpoint=base)]
    for client in clients:
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="llama", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        assert "not Azure OpenAI's deployments" in caught.value.message
        assert "base URL ending in /v1" in caught.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_route_with_a_trailing_slash_is_served(gw: tuple[str, str], stream: bool) -> None:
    """vLLM redirects `/v1/chat/completions/` to the route (FastAPI), and clients follow with
    the body: kvgate serves it as the route."""
    base, key = gw
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base, headers=auth, timeout=30) as c:
        r = c.post("/v1/chat/completions/", json={**CHAT, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.startswith("data: {") and r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.json()["object"] == "chat.completion"
        done = c.post("/v1/completions/", json={"model": "llama", "prompt": "a", "max_tokens": 2})
        assert done.status_code == 200 and done.json()["object"] == "text_completion"
        models = c.get("/v1/models/")
        assert models.status_code == 200 and models.json()["object"] == "list"
        assert c.get("/v1/models/", headers={"Authorization": "Bearer kvg-nope"}).status_code == 401
    assert inflight(base) == 0


@pytest.mark.parametrize("base_url", ["{base}//v1", "{base}/v1//", "{base}/v1/"])
def test_a_base_url_with_doubled_slashes_is_served(gw: tuple[str, str], base_url: str) -> None:
    """`http://host:port/` + `/v1` (the client sends `//v1/chat/completions`) or a base URL
    ending in `//` (`/v1//chat/completions`): runs of slashes are one (vLLM answers 404; kvgate
    has no route with an empty segment), streamed or not, and the models calls too."""
    base, key = gw
    client = openai.OpenAI(base_url=base_url.format(base=base), api_key=key, max_retries=0)
    hi: list[Any] = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(model="llama", messages=hi, max_tokens=2)
    assert answer.choices[0].message.content
    stream = client.chat.completions.create(model="llama", messages=hi, max_tokens=2,
                                            stream=True)
    assert [c for c in stream]
    assert [m.id for m in client.models.list()] == ["llama"]
    assert client.models.retrieve("llama").id == "llama"
    assert inflight(base) == 0


def test_a_model_asked_with_a_trailing_slash_is_that_model(gw: tuple[str, str]) -> None:
    """`GET /v1/models/llama/` is model `llama` (it was a 404 for a model `llama/`)."""
    base, key = gw
    r = httpx.get(f"{base}/v1/models/llama/", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and r.json()["id"] == "llama", r.text


@pytest.mark.parametrize("prefix", ["/openai", "/api"])
def test_an_api_route_under_a_prefix_names_the_base_url(gw: tuple[str, str], prefix: str) -> None:
    """A base URL copied from another provider's (`.../openai/v1`): a 404 that says which base
    URL to use, not a bare "Unknown path"."""
    base, key = gw
    client = openai.OpenAI(base_url=f"{base}{prefix}/v1", api_key=key, max_retries=0)
    hi: list[Any] = [{"role": "user", "content": "hi"}]
    chat: Callable[[], object] = partial(client.chat.completions.create, model="llama",
                                         messages=hi, max_tokens=2)
    for call in (chat, client.models.list):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert "Use the base URL http://HOST:PORT/v1" in caught.value.message
        assert f"without the {prefix} prefix" in caught.value.message


def test_embeddings_on_a_model_without_the_route_say_so() -> None:
    """vLLM registers /v1/embeddings only for an embedding model: a generative model's replica
    answers FastAPI's bare 404 `{"detail": "Not Found"}`. The client gets an OpenAI 404 that
    says the model does not serve embeddings, not "Not Found" that reads as a wrong URL."""
    not_found = whole(orjson.dumps({"detail": "Not Found"}), status=404)
    with BadReplica("m", not_found) as replica:
        proc, base = _auth_gateway(replica.url)
        with proc, admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.NotFoundError) as caught:
                client.embeddings.create(model="llama", input="hi")
            assert "does not serve /v1/embeddings" in caught.value.message
            assert "embedding (pooling) model" in caught.value.message
            assert caught.value.param == "model"
            assert replica.posts == 1  # a client's error, not a replica's failure: no retry
            with pytest.raises(openai.NotFoundError) as chat:
                client.chat.completions.create(model="llama", messages=[
                    {"role": "user", "content": "hi"}])
            assert "does not serve /v1/chat/completions" in chat.value.message
            assert inflight(base) == 0
