"""vLLM 0.34's stream and Responses-API behaviour through a real kvgate (issue 15: 5, 6, 8):
`reasoning` deltas are the first token, `: keep-alive` comments are not, and stored responses
are followed up, read and cancelled on the replica that holds them. The client is the official
openai SDK where it has the call."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import orjson
import pytest
from openai.types.responses import Response

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values
from tests.support.procs import Proc

MODEL = "sim-model"
ADMIN = "streams-admin-token-0123456789"
SimFactory = Callable[..., tuple[Proc, str]]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)


def ttft_count(base: str) -> float:
    return sum(metric_values(base, "kvgate_ttft_seconds_count").values())


def test_reasoning_deltas_are_the_first_token(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", "--reasoning")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        # 3 tokens < the shortest thinking phase (4): the whole answer is `reasoning`
        stream = client(base).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "think"}], max_tokens=3,
            stream=True)
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert any(getattr(d, "reasoning", None) for d in deltas)
        assert not any(d.content for d in deltas)
        assert ttft_count(base) == 1  # TTFT taken at the first reasoning delta


def test_keep_alive_comments_are_not_an_answer(sim_factory: SimFactory) -> None:
    # a replica 1000x slower than real time: it only sends `: keep-alive` while prefilling
    _, sim = sim_factory("--time-scale", "0.001", "--sse-keep-alive-interval", "0.05")
    gw, base = gateway_proc(upstreams=[sim], env={
        "KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "1", "KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "60"})
    with gw:
        body = {"model": MODEL, "prompt": "x " * 500, "max_tokens": 5, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert ": keep-alive" in lines  # relayed as sent ...
        events = [line for line in lines if line.startswith("data:")]
        err = orjson.loads(events[-2][5:])["error"]
        assert events[-1] == "data: [DONE]"
        # ... but they did not satisfy the first-byte timeout
        assert err["code"] == 504 and "first byte" in err["message"]
        assert ttft_count(base) == 0


def test_keep_alive_stream_relays_the_answer_intact(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "20", "--sse-keep-alive-interval", "0.01")
    _, plain = sim_factory("--time-scale", "20")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        texts = []
        for url in (base, plain):
            stream = client(url).completions.create(model=MODEL, prompt="same prompt " * 50,
                                                    max_tokens=8, stream=True)
            texts.append("".join(c.choices[0].text for c in stream if c.choices))
        assert texts[0] == texts[1] and texts[0]


@pytest.mark.parametrize("stream", [False, True])
def test_stored_responses_stay_on_their_replica(sim_factory: SimFactory, stream: bool) -> None:
    sims = [sim_factory("--time-scale", "50", "--enable-store")[1] for _ in range(3)]
    gw, base = gateway_proc(upstreams=sims, args=["--policy", "round_robin"])
    with gw:
        c = client(base)
        first: Response
        if stream:
            with c.responses.stream(model=MODEL, input="Hello", max_output_tokens=4) as s:
                first = s.get_final_response()
        else:
            first = c.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
        prev = first.id
        homes = set()
        # round robin would send each follow-up elsewhere; every other replica answers 404
        for i in range(4):
            raw = c.responses.with_raw_response.create(
                model=MODEL, input=f"and then {i}?", previous_response_id=prev,
                max_output_tokens=4)
            prev = raw.parse().id
            homes.add(raw.headers["x-kvgate-replica"])
            assert raw.headers["x-kvgate-route"] == "response-affinity"
        assert len(homes) == 1
        got = c.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text
        with pytest.raises(openai.BadRequestError):  # it exists there: a finished one
            c.responses.cancel(prev)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve("resp_never_made_here")


def test_a_follow_up_never_continues_another_tenants_response(sim_factory: SimFactory) -> None:
    # one replica: every request reaches the one that holds the stored response, and vLLM
    # would continue it for whoever names its id
    _, sim = sim_factory("--time-scale", "50", "--enable-store")
    config = {"pools": {"p": {"served_model": MODEL, "replicas": [sim]}},
              "tenants": [{"id": "alice", "tier": "default"}, {"id": "bob", "tier": "default"}]}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        alice, bob = (openai.OpenAI(base_url=f"{base}/v1", max_retries=0, timeout=30,
                                    api_key=admin.post(f"/tenants/{t}/keys").json()["key"])
                      for t in ("alice", "bob"))
        secret = alice.responses.create(model=MODEL, input="my password is swordfish",
                                        max_output_tokens=4)
        with pytest.raises(openai.NotFoundError) as err:
            bob.responses.create(model=MODEL, input="what was my password?",
                                 previous_response_id=secret.id, max_output_tokens=4)
        assert err.value.body is not None and secret.id in str(err.value.body)
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(secret.id)
        own = alice.responses.create(model=MODEL, input="and then?", max_output_tokens=4,
                                     previous_response_id=secret.id)
        assert own.previous_response_id == secret.id
