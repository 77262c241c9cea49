"""Issue 12 end to end: flow control's admission queue in a real gateway in front of a real
simulated replica made saturated (``--max-num-seqs 2``, a little latency), with real Redis
behind the tenancy limits.

One stack per module (Redis, one replica, one gateway with auth); each test makes its own
tenants and waits for the pool to drain before it ends. Saturation is what the gateway sees:
vLLM's scraped waiting queue above ``flow.max_waiting: 0`` (scrapes every 50 ms), so the
pool is saturated once a third long request waits behind the two the replica runs.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "flow-admin-token-0123456789"
POOL = "p"
POLICY: dict[str, Any] = {
    "models": {"m": {"default": POOL}},
    "tiers": {
        "default": {},
        "premium": {"priority": 0},
        "free": {"priority": 1},
        "impatient": {"priority": 1, "flow": {"max_wait_s": 0.5}},
        "capped": {"priority": 1, "limits": {"max_concurrency": 2}},
    },
}
FLOW = {"enabled": True, "max_waiting": 0, "max_unanswered": 1, "tick_ms": 5}
LONG = 4000  # tokens of a filler: ~25 s at the simulator's ~6 ms per step
LONG_PROMPT = "Tell me about the weather in a city by the sea. " * 100  # ~1,200 tokens
_ids = itertools.count()


@dataclass
class Stack:
    base: str
    sim: str
    redis: str
    env: dict[str, str]
    config: dict[str, Any]
    fillers: list[Filler] = field(default_factory=list)

    def tenant(self, tier: str) -> str:
        return self.tenant_with_id(tier)[1]

    def tenant_with_id(self, tier: str) -> tuple[str, str]:
        """A new tenant of ``tier``: its id and an API key."""
        tid = f"f{next(_ids)}-{uuid.uuid4().hex[:6]}"
        with admin_client(self.base, ADMIN) as admin:
            assert admin.post("/tenants", json={"id": tid, "tier": tier}).status_code == 201
            created = admin.post(f"/tenants/{tid}/keys")
            assert created.status_code == 201
            return tid, str(created.json()["key"])


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        redis, url = redis_proc()
        procs.append(redis.start())
        sim, sim_url = sim_proc(None, "--max-num-seqs", "2", "--latency-ms", "20", model="m-sim")
        procs.append(sim.start())
        config = {**POLICY, "pools": {POOL: {"served_model": "m-sim", "replicas": [sim_url]}},
                  "routing": {"scrape_interval_ms": 50}, "flow": FLOW}
        env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
               "KVGATE_ADMIN_TOKEN": f"ops:{ADMIN}"}
        gw, base = gateway_proc(config=config, env=env, auth=True)
        procs.append(gw.start())
        yield Stack(base, sim_url, url, env, config)
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture
def s(stack: Stack) -> Iterator[Stack]:
    yield stack
    for filler in stack.fillers:
        filler.stop()
    stack.fillers.clear()
    wait_for(lambda: inflight(stack.base) == 0 and depth(stack.base) == 0, 30,
             "the pool to drain")


def depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def saturated(base: str) -> bool:
    return metric_values(base, "kvgate_flow_saturated").get(f'{{pool="{POOL}"}}') == 1.0


def body(max_tokens: int, text: str = "Hello", stream: bool = True) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


class Call(threading.Thread):
    """One streamed request in the background: its status, route, first chunk and end."""

    def __init__(self, base: str, key: str, max_tokens: int, timeout: float = 60.0,
                 text: str = "Hello") -> None:
        super().__init__(daemon=True)
        self.base, self.key, self.max_tokens, self.timeout = base, key, max_tokens, timeout
        self.text = text
        self.status = 0
        self.route = ""
        self.headers: httpx.Headers | None = None
        self.first: float | None = None
        self.end: float | None = None
        self.error: str | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=self.timeout) as client, client.stream(
                "POST", f"{self.base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {self.key}"},
                json=body(self.max_tokens, self.text),
            ) as resp:
                self.status, self.headers = resp.status_code, resp.headers
                self.route = resp.headers.get("x-kvgate-route", "")
                for chunk in resp.iter_raw():
                    if chunk and self.first is None and resp.status_code == 200:
                        self.first = time.monotonic()
                    if self._halt.is_set():
                        return
        except httpx.HTTPError as exc:
            self.error = type(exc).__name__
        finally:
            self.end = time.monotonic()

    def stop(self) -> None:
        self._halt.set()


class Filler(Call):
    """A long request that keeps a seat busy until stopped."""


def saturate(s: Stack, key: str, base: str | None = None) -> None:
    """Two long requests run, a third waits inside vLLM: the pool is saturated (the stack's
    gateway, or the one at ``base``; its fillers stop with the stack's)."""
    base = base or s.base
    for _ in range(3):
        f = Filler(base, key, LONG)
        f.start()
        s.fillers.append(f)
        time.sleep(0.15)
    wait_for(lambda: saturated(base), 10, "the pool to be saturated")


def release(s: Stack) -> None:
    for f in s.fillers:
        f.stop()


def answered(call: Call) -> bool:
    return call.first is not None


def queued(s: Stack, n: int) -> None:
    wait_for(lambda: depth(s.base) == n, 10, f"{n} requests queued")


# -- tests ------------------------------------------------------------------------------------
def sdk(base: str, key: str, timeout: float = 30.0) -> openai.OpenAI:
    """The official client, no retries (a 429 must reach the test)."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=timeout)


def test_no_saturation_no_queueing(s: Stack) -> None:
    key = s.tenant("free")
    before = sum(metric_values(s.base, "kvgate_flow_queued_total").values())
    with sdk(s.base, key) as client:
        for _ in range(10):
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=5)
            assert raw.parse().choices[0].message.content
            assert raw.headers["x-kvgate-route"] != "queued"
    assert sum(metric_values(s.base, "kvgate_flow_queued_total").values()) == before
    assert not saturated(s.base)
    assert inflight(s.base) == 0


def test_premium_queued_after_free_finishes_first(s: Stack) -> None:
    free, premium = s.tenant("free"), s.tenant("premium")
    saturate(s, s.tenant("free"))
    frees = [Call(s.base, free, 30) for _ in range(4)]
    for c in frees:
        c.start()
    queued(s, 4)
    prems = [Call(s.base, premium, 30) for _ in range(2)]
    for c in prems:
        c.start()
    queued(s, 6)
    release(s)
    for c in [*frees, *prems]:
        c.join(30)
        assert c.status == 200 and c.route == "queued", (c.status, c.route, c.error)
    assert all(c.end is not None for c in [*frees, *prems])
    assert max(c.end or 0.0 for c in prems) < min(c.end or 0.0 for c in frees)
    waits = metric_values(s.base, "kvgate_flow_wait_seconds_count")
    assert waits.get('{tier="premium"}', 0) >= 2 and waits.get('{tier="free"}', 0) >= 4


def test_equal_weight_tenants_get_equal_token_shares(s: Stack) -> None:
    """Tenant a queues 24 short requests, then b 12 twice as long: released alternately by
    tokens, not requests (FCFS would serve all of a's first)."""
    a, b = s.tenant("free"), s.tenant("free")
    saturate(s, s.tenant("free"))
    calls_a = [Call(s.base, a, 40) for _ in range(24)]
    for c in calls_a:
        c.start()
    queued(s, 24)
    calls_b = [Call(s.base, b, 80) for _ in range(12)]
    for c in calls_b:
        c.start()
    queued(s, 36)
    release(s)
    for c in [*calls_a, *calls_b]:
        c.join(60)
        assert c.status == 200 and c.first is not None, (c.status, c.error)
    # release order = first-chunk order; compare the tokens each got while both waited
    order = sorted([*calls_a, *calls_b], key=lambda c: c.first or 0.0)
    last_b = max(i for i, c in enumerate(order) if c in calls_b)
    last_a = max(i for i, c in enumerate(order) if c in calls_a)
    window = order[: min(last_a, last_b)]
    tokens_a = sum(c.max_tokens for c in window if c in calls_a)
    tokens_b = sum(c.max_tokens for c in window if c in calls_b)
    assert abs(tokens_a - tokens_b) <= 0.1 * max(tokens_a, tokens_b) + 80, (tokens_a, tokens_b)


def test_a_tenant_over_its_share_lets_the_other_tenants_pass(s: Stack) -> None:
    """The noisy tenant's own three fillers saturate the pool (it holds all the in-flight
    tokens), each sent straight through so the queue has no history of it. Its three short
    requests queue, then one each of two other tenants of the same tier: fair queueing alone
    would send the noisy one first (same virtual time, queued first). Over its share (twice its
    third), it is passed over: the others go first, then its own (work-conserving)."""
    noisy, quiet, other = s.tenant("free"), s.tenant("free"), s.tenant("free")
    fill(s, noisy)
    mine = [Call(s.base, noisy, 30) for _ in range(3)]
    for c in mine:
        c.start()
    queued(s, 3)
    others = [Call(s.base, quiet, 30), Call(s.base, other, 30)]
    for c in others:
        c.start()
    queued(s, 5)
    s.fillers[0].stop()  # a running filler and the one waiting inside vLLM leave: one seat
    s.fillers[2].stop()
    for c in [*others, *mine]:
        c.join(60)
        assert c.status == 200 and c.route == "queued" and c.first is not None, (
            c.status, c.route, c.error)
    assert max(c.first or 0.0 for c in others) < min(c.first or 0.0 for c in mine)


def test_disconnect_while_queued_leaves_at_once(s: Stack) -> None:
    key = s.tenant("free")
    saturate(s, s.tenant("free"))
    before = sum(metric_values(s.base, "kvgate_flow_abandoned_total").values())
    gone = Call(s.base, key, 30, timeout=1.0)  # the client gives up after 1 s
    gone.start()
    queued(s, 1)
    gone.join(5)
    assert gone.error is not None and gone.status == 0
    # out of the queue at once, while the pool is still saturated (not at its turn)
    wait_for(lambda: depth(s.base) == 0, 2, "the queue to empty")
    assert saturated(s.base)
    abandoned = sum(metric_values(s.base, "kvgate_flow_abandoned_total").values())
    assert abandoned == before + 1
    release(s)
    wait_for(lambda: inflight(s.base) == 0, 30, "the fillers to end")
    # nothing leaked: a new request is admitted and nothing stays queued or in flight
    ok = Call(s.base, key, 5)
    ok.start()
    ok.join(30)
    assert ok.status == 200 and depth(s.base) == 0


def test_max_wait_is_a_429_with_retry_after(s: Stack) -> None:
    key = s.tenant("impatient")
    saturate(s, s.tenant("free"))
    t0 = time.monotonic()
    with sdk(s.base, key) as client, pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=5)
    waited = time.monotonic() - t0
    resp = err.value.response
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
    assert resp.json()["error"]["type"] == "RateLimitError"
    assert 0.4 <= waited < 3.0
    shed = metric_values(s.base, "kvgate_flow_shed_total")
    assert shed.get(f'{{pool="{POOL}",reason="max_wait",tier="impatient"}}', 0) >= 1


def test_a_shed_request_counts_under_its_pool_and_retries_after_the_stall(s: Stack) -> None:
    """A gateway of its own that has sent nothing sees the pool saturated (the stack's gateway
    filled it): no dispatch to estimate the queue's drain from. A request shed at its tier's
    2 s longest wait is told to retry after at least that long, not after 1 s (every shed
    client back at once); it is counted under the pool it was queued for (not pool "none"),
    as is a request whose client left the queue. A gateway of its own on a Redis database of
    its own (its own policy)."""
    tiers = {**POLICY["tiers"], "slow": {"priority": 1, "flow": {"max_wait_s": 2}}}
    env = {**s.env, "KVGATE_REDIS_URL": s.redis.rsplit("/", 1)[0] + "/5"}
    gw, base = gateway_proc(config={**s.config, "tiers": tiers}, env=env, auth=True)
    with gw:
        keys = {}
        with admin_client(base, ADMIN) as admin:
            for tier in ("slow", "free"):
                tid = f"shed-{tier}-{uuid.uuid4().hex[:6]}"
                assert admin.post("/tenants", json={"id": tid, "tier": tier}).status_code == 201
                keys[tier] = str(admin.post(f"/tenants/{tid}/keys").json()["key"])
        saturate(s, s.tenant("free"))  # through the stack's gateway
        wait_for(lambda: saturated(base), 10, "the other gateway to see the pool saturated")
        with sdk(base, keys["slow"]) as client, pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=5)
        resp = err.value.response
        assert int(resp.headers["retry-after"]) >= 2
        assert resp.json()["error"]["code"] == "queue_shed"
        gone = Call(base, keys["free"], 5, timeout=1.0)  # leaves the queue after 1 s
        gone.start()
        wait_for(lambda: depth(base) == 1, 10, "1 queued")
        gone.join(5)

        def counted(mark: str) -> list[str]:
            return [k for k in metric_values(base, "kvgate_requests_total") if mark in k]

        wait_for(lambda: bool(counted('route="shed"') and counted('status="499"')), 10,
                 "the shed and the abandoned request counted")
        for key in counted('route="shed"') + counted('status="499"'):
            assert f'pool="{POOL}"' in key, key
        release(s)
        wait_for(lambda: inflight(s.base) == 0, 30, "drained")


def test_queued_requests_count_against_concurrency_once(s: Stack) -> None:
    """Two queued requests hold the tenant's two concurrency leases (Redis): a third is a
    429 for concurrency at once; after they are served the leases are back."""
    key = s.tenant("capped")
    saturate(s, s.tenant("free"))
    calls = [Call(s.base, key, 5) for _ in range(2)]
    for c in calls:
        c.start()
    queued(s, 2)
    with httpx.Client(timeout=10) as client:
        resp = client.post(f"{s.base}/v1/chat/completions", json=body(5, stream=False),
                           headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 429 and "concurrent" in resp.json()["error"]["message"]
    assert depth(s.base) == 2
    release(s)
    for c in calls:
        c.join(30)
        assert c.status == 200
    with httpx.Client(timeout=30) as client:
        for _ in range(2):  # both leases released: two in a row pass again
            resp = client.post(f"{s.base}/v1/chat/completions", json=body(5, stream=False),
                               headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200


def test_clients_leaving_the_queue_give_back_their_concurrency_leases(s: Stack) -> None:
    """Two queued requests of a tenant allowed two at once, whose clients give up while
    they wait: their leases (in Redis) are released with them, so the tenant's next two
    requests are not 429s for concurrency once the pool has room."""
    key = s.tenant("capped")
    saturate(s, s.tenant("free"))
    gone = [Call(s.base, key, 5, timeout=1.0) for _ in range(2)]
    for c in gone:
        c.start()
    queued(s, 2)
    for c in gone:
        c.join(5)
        assert c.error is not None and c.status == 0
    wait_for(lambda: depth(s.base) == 0, 2, "the queue to empty")
    release(s)
    wait_for(lambda: inflight(s.base) == 0, 30, "the fillers to end")
    calls = [Call(s.base, key, 5) for _ in range(2)]
    for c in calls:
        c.start()
    for c in calls:
        c.join(30)
        assert c.status == 200, c.error


def test_explain_says_whether_a_request_would_queue(s: Stack) -> None:
    with admin_client(s.base, ADMIN) as admin:
        idle = admin.post("/route/explain", json={"tier": "free", "request": body(5)}).json()
        assert idle["flow"]["enabled"] and not idle["flow"]["would_queue"]
        saturate(s, s.tenant("free"))
        busy = admin.post("/route/explain", json={"tier": "free", "request": body(5)}).json()
        assert busy["flow"]["would_queue"] and busy["flow"]["saturated"]
        assert busy["flow"]["band"] == 1 and busy["flow"]["replicas"]
        pools = admin.get("/replicas").json()["data"]
        assert pools[0]["flow"]["saturated"]


def fill(s: Stack, key: str) -> None:
    """``key``'s own three fillers saturate the pool, each sent straight through."""
    for i in range(3):
        f = Filler(s.base, key, LONG)
        f.start()
        s.fillers.append(f)
        if i < 2:  # the third waits inside vLLM behind the two running
            wait_for(partial(answered, f), 10, "the filler's first token")
    wait_for(lambda: saturated(s.base), 10, "the pool to be saturated")


def send_long(s: Stack, key: str, n: int) -> None:
    """``key`` sends ``n`` requests of a long prompt one after the other, each answered with a
    token of output: tokens sent lately, none held. (Streams left at their first token no
    longer count their ``max_tokens`` as sent: a request keeps what it used.)"""
    client = sdk(s.base, key)
    for _ in range(n):
        answer = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=1)
        assert answer.usage is not None and answer.usage.prompt_tokens > 1000, answer.usage
    wait_for(lambda: inflight(s.base) == 0, 10, "the requests to end")


def share_of(s: Stack, tenant: str) -> dict[str, Any]:
    with admin_client(s.base, ADMIN) as admin:
        out = admin.post("/route/explain", json={"tenant": tenant, "request": body(5)})
        assert out.status_code == 200, out.text
        flow: dict[str, Any] = out.json()["flow"]
        return flow


def test_explain_says_a_hog_waits_for_spare_room(s: Stack) -> None:
    """The noisy tenant holds every in-flight token and sent most tokens lately (the earlier
    tests' too count in the pool's recent tokens) while two others wait: a hog, and the
    saturated replica has no spare room, so its next request waits for one. The others are
    under their shares."""
    (noisy, key), (quiet, _) = s.tenant_with_id("free"), s.tenant_with_id("free")
    send_long(s, key, 25)
    fill(s, key)
    others = [Call(s.base, s.tenant("free"), 30), Call(s.base, s.tenant("free"), 30)]
    for c in others:
        c.start()
    queued(s, 2)
    hog = share_of(s, noisy)
    assert hog["over_share"] and hog["hog"] and hog["waits_for_spare"], hog
    assert hog["spare_replicas"] == [] and hog["would_queue"]
    assert hog["inflight_share"] == 1.0 and 2 * hog["fair_share"] < hog["recent_share"] <= 1
    assert hog["fair_share"] == pytest.approx(1 / 3, abs=1e-3) and hog["share_cap"] == 2.0
    other = share_of(s, quiet)  # holds nothing: cannot be over its share
    assert not (other["over_share"] or other["hog"] or other["waits_for_spare"]), other
    assert other["spare_replicas"] is None and other["fair_share"] is None
    release(s)
    for c in others:
        c.join(60)
        assert c.status == 200


def test_explain_says_one_long_holding_is_over_share_but_no_hog(s: Stack) -> None:
    """A tenant that holds every in-flight token but sent under its share of the tokens lately
    (another tenant sent more, now finished) is over its share, not a hog: it is not held to
    spare room."""
    (holder, key), busy = s.tenant_with_id("free"), s.tenant("free")
    send_long(s, busy, 10)
    fill(s, key)
    others = [Call(s.base, s.tenant("free"), 30), Call(s.base, s.tenant("free"), 30)]
    for c in others:
        c.start()
    queued(s, 2)
    got = share_of(s, holder)
    assert got["over_share"] and not got["hog"] and not got["waits_for_spare"], got
    assert got["spare_replicas"] is None and got["inflight_share"] == 1.0
    assert got["recent_share"] < 2 * got["fair_share"]
    release(s)
    for c in others:
        c.join(60)
        assert c.status == 200


def test_policy_hot_reload_moves_tiers_and_rejects_bad_weights(s: Stack) -> None:
    """Bands and weights are policy: a PUT through the admin API reaches the queue without a
    restart (explain shows it); a bad weight or band floor is a 400 naming the field."""
    with admin_client(s.base, ADMIN) as admin:
        got = admin.get("/policy")
        assert got.status_code == 200
        old, etag = got.json(), got.headers["etag"]

        def explain() -> dict[str, Any]:
            out = admin.post("/route/explain", json={"tier": "free", "request": body(5)})
            flow: dict[str, Any] = out.json()["flow"]
            return flow

        assert (explain()["band"], explain()["weight"]) == (1, 1.0)
        new = {**old, "tiers": {**old["tiers"], "free": {**old["tiers"]["free"],
                                                         "flow": {"band": 0, "weight": 3}}},
               "fairness": {"min_share": {"1": 0.2}, "tenants": {}}}
        put = admin.put("/policy", json=new, headers={"if-match": etag})
        assert put.status_code == 200, put.text
        try:
            wait_for(lambda: (explain()["band"], explain()["weight"]) == (0, 3.0), 10,
                     "the new policy in the queue")
            bad = {**new, "tiers": {**new["tiers"], "free": {"flow": {"weight": -1}}}}
            err = admin.put("/policy", json=bad)
            assert err.status_code == 400
            assert "tiers.free.flow.weight" in err.json()["error"]["param"], err.text
            floors = {**new, "fairness": {"min_share": {"1": 0.6, "2": 0.5}}}
            err = admin.put("/policy", json=floors)
            assert err.status_code == 400 and "min_share" in err.text, err.text
        finally:
            restore = admin.put("/policy", json=old)
            assert restore.status_code == 200, restore.text
        wait_for(lambda: explain()["band"] == 1, 10, "the old policy back")


def test_queue_full_sheds_lower_band_with_429_and_top_band_gets_503(s: Stack) -> None:
    """A gateway of its own with room for two: free requests fill it; a premium one
    displaces the newest free (429); once full of premium, premium gets 503 (overload)."""
    config = {**s.config, "flow": {**FLOW, "max_queue": 2}}
    gw, base = gateway_proc(config=config, env=s.env, auth=True)
    with gw:
        free, premium = s.tenant("free"), s.tenant("premium")
        saturate(s, free, base)
        frees = [Call(base, free, 5) for _ in range(2)]
        for c in frees:
            c.start()
        wait_for(lambda: depth(base) == 2, 10, "2 queued")
        with httpx.Client(timeout=10) as client:
            third = client.post(f"{base}/v1/chat/completions", json=body(5, stream=False),
                                headers={"Authorization": f"Bearer {free}"})
        assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1
        assert third.json()["error"]["code"] == "queue_shed"
        prems = [Call(base, premium, 5) for _ in range(2)]
        for c in prems:
            c.start()
            time.sleep(0.2)
        for c in frees:
            c.join(10)
            assert c.status == 429 and c.headers is not None and "retry-after" in c.headers
        with httpx.Client(timeout=10) as client:
            over = client.post(f"{base}/v1/chat/completions", json=body(5, stream=False),
                               headers={"Authorization": f"Bearer {premium}"})
        assert over.status_code == 503 and int(over.headers["retry-after"]) >= 1
        # every flow-control shed carries one string code, 429 or 503 (the 503 had 503)
        assert over.json()["error"]["code"] == "queue_shed"
        release(s)
        for c in prems:
            c.join(30)
            assert c.status == 200
        wait_for(lambda: inflight(base) == 0, 30, "drained")


def test_spill_over_is_tried_before_queueing(s: Stack) -> None:
    """A tier with `spill_to`: while its pool is saturated its request goes to the spill pool
    at once (route "spill"), not into the queue. A gateway of its own (two pools) on a Redis
    database of its own (its own policy)."""
    sim2, sim2_url = sim_proc(None, "--max-num-seqs", "8", model="m-sim")
    tiers = {**POLICY["tiers"], "spiller": {"priority": 1, "spill_to": "q"}}
    config = {**s.config, "tiers": tiers,
              "pools": {POOL: {"served_model": "m-sim", "replicas": [s.sim]},
                        "q": {"served_model": "m-sim", "replicas": [sim2_url]}}}
    env = {**s.env, "KVGATE_REDIS_URL": s.redis.rsplit("/", 1)[0] + "/3"}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with sim2, gw:
        keys = {}
        with admin_client(base, ADMIN) as admin:
            for tier in ("free", "spiller"):
                tid = f"spill-{tier}-{uuid.uuid4().hex[:6]}"
                assert admin.post("/tenants", json={"id": tid, "tier": tier}).status_code == 201
                keys[tier] = str(admin.post(f"/tenants/{tid}/keys").json()["key"])
        saturate(s, keys["free"], base)
        with admin_client(base, ADMIN) as admin:  # explain says what dispatch does below
            plan = admin.post("/route/explain",
                              json={"tier": "spiller", "request": body(5, stream=False)}).json()
        assert (plan["pool"], plan["tier_route"], plan["replica"]) == (
            "q", "spill", sim2_url.removeprefix("http://"))
        assert not plan["flow"]["would_queue"] and plan["flow"]["spills_to"] == "q"
        assert plan["flow"]["saturated"]  # its home pool's state, which it avoids
        # a filler may have queued on a loaded machine: count the spiller's request alone
        queued = sum(metric_values(base, "kvgate_flow_queued_total").values())
        with sdk(base, keys["spiller"]) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=5)
        assert raw.headers["x-kvgate-route"] == "spill"
        assert raw.headers["x-kvgate-replica"].startswith("q/")
        assert sum(metric_values(base, "kvgate_flow_queued_total").values()) == queued
        release(s)
        wait_for(lambda: inflight(base) == 0, 30, "drained")


def test_shutdown_grace_ends_a_queued_request_as_interrupted(s: Stack) -> None:
    """SIGTERM with a request queued: it is answered 503 (the OpenAI shape, `Retry-After`;
    at once, test_flow_shutdown.py) and recorded as interrupted, like the streams the grace cut;
    not as flow control's "shed" (nothing was counted in kvgate_flow_shed_total for it). A
    gateway of its own (it is stopped) on a Redis database of its own."""
    config = {**s.config, "server": {"shutdown_grace_s": 1, "log_level": "info"}}
    env = {**s.env, "KVGATE_REDIS_URL": s.redis.rsplit("/", 1)[0] + "/4"}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw:
        with admin_client(base, ADMIN) as admin:
            tid = f"term-{uuid.uuid4().hex[:6]}"
            assert admin.post("/tenants", json={"id": tid, "tier": "free"}).status_code == 201
            key = str(admin.post(f"/tenants/{tid}/keys").json()["key"])
        saturate(s, key, base)
        waiting = Call(base, key, 5, text="queued at shutdown")
        waiting.start()
        queued(Stack(base, s.sim, s.redis, env, config), 1)
        gw.signal(signal.SIGTERM)
        waiting.join(30)
        assert gw.popen is not None and gw.popen.wait(15) == 0
        records: list[dict[str, Any]] = [
            orjson.loads(line) for line in gw.output(None).splitlines()
            if line.startswith("{") and '"msg":"request"' in line]
    assert waiting.status == 503 and waiting.headers is not None
    assert int(waiting.headers["retry-after"]) >= 1
    mine = [r for r in records if r["queued_ms"] is not None]
    assert len(mine) == 1
    assert (mine[0]["status"], mine[0]["route"]) == (503, "interrupted")


def served_tokens(s: Stack) -> float:
    """All tenants' (past the metrics' tenant limit a new one's label is another's)."""
    return sum(metric_values(s.base, "kvgate_flow_served_tokens_total").values())


def test_a_request_its_replica_refuses_is_charged_its_prompt_only(s: Stack) -> None:
    """A ``max_tokens`` beyond the model's context: the replica answers 400 before any output.
    It was charged 2^24 tokens of output at its send, and kept them: a few such requests made
    its tenant look like it took the whole pool lately. Now the charge is at most what fits in
    the pool's context (``max_model_len``, learned from the replicas), and a refused request
    keeps only its prompt: the fair-share view and the in-flight counts are back to nothing."""
    tenant, key = s.tenant_with_id("free")
    wait_for(lambda: "max_model_len" in httpx.get(
        f"{s.base}/v1/models/m", headers={"Authorization": f"Bearer {key}"}).json(),
        10, "the pool's context length learned")
    context = httpx.get(f"{s.base}/v1/models/m",
                        headers={"Authorization": f"Bearer {key}"}).json()["max_model_len"]
    with admin_client(s.base, ADMIN) as admin:
        out = admin.post("/route/explain", json={"tenant": tenant, "request": body(10**9)})
        assert out.status_code == 200, out.text
        assert out.json()["flow"]["cost_tokens"] <= context  # not 2^24 and more
    before = served_tokens(s)  # the pool is drained: nothing else is counted meanwhile
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            resp = client.post(f"{s.base}/v1/chat/completions",
                               headers={"Authorization": f"Bearer {key}"},
                               json=body(10**9, stream=False))
            assert resp.status_code == 400, resp.text
    charged = served_tokens(s) - before
    assert 0 < charged < 3 * 100, charged  # three short prompts, no output
    assert inflight(s.base) == 0
    view = share_of(s, tenant)
    assert view["inflight_share"] == 0 and view["fair_share"] is None, view
    assert not (view["over_share"] or view["hog"] or view["waits_for_spare"]), view
    good = sdk(s.base, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=5)
    assert good.choices[0].finish_reason is not None
    assert served_tokens(s) - before > charged  # an answered request keeps its charge


def test_an_embedding_is_charged_its_prompt_only(s: Stack) -> None:
    """An embedding generates nothing: flow control charged it `flow.expected_output_tokens`
    (256 by default), or the ``max_tokens`` its body happened to carry, on top of its prompt,
    so a tenant embedding a corpus looked like one generating, to the share cap and the
    fair-share order."""
    tenant, key = s.tenant_with_id("free")
    text = "kvgate embeds this sentence. " * 8
    with admin_client(s.base, ADMIN) as admin:
        for request in ({"model": "m", "input": text}, {"model": "m", "input": text,
                                                          "max_tokens": 5000, "n": 3}):
            out = admin.post("/route/explain", json={
                "tenant": tenant, "endpoint": "embeddings", "request": request})
            assert out.status_code == 200, out.text
            cost = out.json()["flow"]["cost_tokens"]
            assert 0 < cost <= len(text) / 4 + 1, cost  # the prompt estimate alone
    before = served_tokens(s)
    answer = sdk(s.base, key).embeddings.create(model="m", input=text,
                                                extra_body={"max_tokens": 5000})
    assert answer.data and answer.usage.total_tokens > 0
    assert served_tokens(s) - before == cost
    assert inflight(s.base) == 0


def test_a_request_the_gateway_refuses_after_flow_control_is_charged_nothing(
    s: Stack,
) -> None:
    """A request let through flow control that the gateway itself then refuses before any
    replica saw it (here the client's own ``cache_salt`` under ``tenancy.client_salt:
    reject``: a 400 written when the upstream body is) ran nothing at all: its tenant is
    charged nothing, neither in the served tokens nor in its band's share."""
    config = {**s.config, "tenancy": {"client_salt": "reject"}}
    gw, base = gateway_proc(config=config, env={**s.env, "KVGATE_REDIS_URL": ""}, auth=True)
    with gw:
        mine = Stack(base, s.sim, s.redis, s.env, config)
        key = mine.tenant("free")
        before = served_tokens(mine)
        with httpx.Client(timeout=30) as client:
            for _ in range(3):
                resp = client.post(f"{base}/v1/chat/completions",
                                   headers={"Authorization": f"Bearer {key}"},
                                   json={**body(1000, stream=False), "cache_salt": "mine"})
                assert resp.status_code == 400, resp.text
                assert resp.json()["error"]["param"] == "cache_salt"
        after = served_tokens(mine)
        assert after == before, after - before
        assert inflight(base) == 0
