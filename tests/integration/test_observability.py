"""Observability end to end: a real gateway (auth, Redis) in front of real simulated replicas.

Traffic covers streamed and whole answers, a spill-over, an upstream 503 retried on another
replica (a failover), a rate-limit 429 and an unknown model. Then, mechanically:
- every metric the Grafana dashboard and the Prometheus rules read has samples in the live
  exposition of the gateway or of a replica (vLLM's names, as the simulator serves them);
- the gateway exports exactly the kvgate_* families docs/metrics.md lists;
- each request left one JSON log line with its fields, and no prompt, key or secret.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_observability_assets import (
    _dashboard_exprs,
    _rules,
    documented_kvgate_metrics,
    metric_names,
)
from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "obs-admin-token-0123456789"
SIM_ARGS = ("--time-scale", "50")
MODEL = "sim-model"
PROMPT_MARK = "confidential-prompt-marker-7f3a"  # must never reach a log line
POLICY: dict[str, Any] = {
    # premium spills to b as soon as a's replica has two queued requests. Not one: b counts
    # as saturated at the same level, and a scrape of b can catch one of the test's own
    # requests queued for an engine step (a loaded machine delays the step), which would
    # make premium stay at home, behind a's endless generations.
    "models": {MODEL: {"default": "a", "premium": "a", "free": "b"}},
    "tiers": {"default": {},
              "premium": {"spill_to": "b", "spill_when": {"waiting": 2, "kv_usage": 1.0}},
              "free": {"limits": {"rpm": 2}}},
    "routing": {"policy": "round_robin", "scrape_interval_ms": 100},
    # flow control on (its families are exported) with bounds nothing here reaches, so the
    # spill-over and the 429s below behave as without it
    "flow": {"enabled": True, "max_prefill_tokens": 10**9, "max_unanswered": None,
             "max_waiting": 10**6, "kv_knee": 1.0, "room_only": False},
}
_ids = itertools.count()


@dataclass
class Stack:
    gateway: str
    replica: str  # a healthy simulated replica (its /metrics holds vLLM's names)
    proc: Proc

    def tenant(self, tier: str) -> tuple[str, str]:
        tid = f"obs{next(_ids)}-{uuid.uuid4().hex[:6]}"
        with admin_client(self.gateway, ADMIN) as admin:
            assert admin.post("/tenants", json={"id": tid, "tier": tier}).status_code == 201
            created = admin.post(f"/tenants/{tid}/keys")
            assert created.status_code == 201
            return tid, created.json()["key"]

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.gateway}/v1", api_key=key, max_retries=0,
                             timeout=30)

    def log_lines(self) -> list[dict[str, Any]]:
        """The gateway's JSON log lines so far: complete lines only (the one being written
        while this reads is left for the next call)."""
        text = Path(self.proc._log.name).read_text(errors="replace")
        complete = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in complete.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        redis, url = redis_proc()
        procs.append(redis.start())
        a_proc, a = sim_proc(None, "--max-num-seqs", "1", model=MODEL)  # real time
        b_proc, b = sim_proc(None, *SIM_ARGS, model=MODEL)
        bad_proc, bad = sim_proc(None, *SIM_ARGS, "--error-rate", "1", "--error-status", "503",
                                 model=MODEL)
        procs += [a_proc.start(), b_proc.start(), bad_proc.start()]
        config = {**POLICY, "pools": {
            "a": {"served_model": MODEL, "replicas": [a]},
            "b": {"served_model": MODEL, "replicas": [b, bad]},
        }}
        env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
               "KVGATE_ADMIN_TOKEN": f"ops:{ADMIN}"}
        gw, base = gateway_proc(config=config, env=env, auth=True,
                                args=["--log-level", "info", "--log-format", "json"])
        procs.append(gw.start())
        yield Stack(base, b, gw)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _messages(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"{PROMPT_MARK} {text} " + "lorem ipsum " * 40}]


async def _chat(client: openai.AsyncOpenAI, text: str, *, stream: bool,
                rid: str | None = None, max_tokens: int = 8) -> str:
    headers = {"X-Request-Id": rid} if rid else None
    if not stream:
        resp = await client.chat.completions.create(
            model=MODEL, messages=_messages(text), max_tokens=max_tokens, extra_headers=headers)
        return resp.choices[0].message.content or ""
    out = await client.chat.completions.create(
        model=MODEL, messages=_messages(text), max_tokens=max_tokens,
        stream=True, extra_headers=headers, stream_options={"include_usage": True})
    return "".join([c.choices[0].delta.content or "" async for c in out if c.choices])


async def _leave_mid_stream(base: str, key: str, i: int, gone: asyncio.Event) -> None:
    """A long streamed chat whose client closes its connection when `gone` is set (closing
    the connection itself: a cancelled SDK call may leave it open until collected)."""
    body = {"model": MODEL, "messages": _messages(f"long {i}"), "max_tokens": 30000,
            "ignore_eos": True, "stream": True}  # really long: no natural end of the text
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        req = client.build_request("POST", "/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"})
        resp = await client.send(req, stream=True)
        await gone.wait()
        await resp.aclose()


def _exposition(url: str) -> dict[str, int]:
    """Sample name -> number of samples, for one live /metrics page (declared-but-empty
    families count 0 under every series name their type produces)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        for suffix in suffixes.get(family.type, ("",)):
            out.setdefault(family.name + suffix, 0)
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0) + 1
    return out


# how long to wait for another process's state to show what the traffic did: generous, as
# a loaded machine can delay the gateway's scrapes and unwinding by seconds (a deadline only
# bounds a failing run; a passing one waits only as long as the condition takes)
DEADLINE_S = 60.0


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll another process's state (blocking HTTP in a thread) until `condition` holds."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not await asyncio.to_thread(condition):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # no event crosses the process boundary


def _series(base: str, name: str, labels: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return max([float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(name + "{") and labels in line] or [0.0])


async def _send_traffic(stack: Stack) -> None:
    premium = stack.client(stack.tenant("premium")[1])
    for i in range(2):  # before pool a was scraped: served at home or spilled, either is fine
        assert await _chat(premium, f"warm {i}", stream=True)
    # Saturate pool a (one sequence at a time, real-time engine): three long generations, two
    # queued, so a reports waiting >= 2 and premium requests spill to b.
    default_key = stack.tenant("default")[1]
    gone = asyncio.Event()
    long = [asyncio.create_task(_leave_mid_stream(stack.gateway, default_key, i, gone))
            for i in range(3)]
    await _until(lambda: _series(stack.gateway, "kvgate_replica_waiting", 'pool="a"') >= 2,
                 "pool a saturated")
    for i in range(8):  # spilled; round robin over b's good and 503-answering replica
        assert await _chat(premium, f"spill {i}", stream=i % 2 == 0)
    gone.set()  # the clients go away (499); the replica aborts the generations
    await asyncio.gather(*long)
    free = stack.client(stack.tenant("free")[1])
    with pytest.raises(openai.RateLimitError):
        for i in range(3):
            await _chat(free, f"limited {i}", stream=False)
    with pytest.raises(openai.NotFoundError):
        await premium.chat.completions.create(model="no-such-model", messages=[
            {"role": "user", "content": "x"}])
    await _until(lambda: _exposition(stack.gateway).get(
        "kvgate_replica_prefix_cache_hit_ratio", 0) > 0, "a hit ratio from two scrapes")


@pytest.fixture(scope="module")
def traffic(stack: Stack) -> Stack:
    try:
        asyncio.run(_send_traffic(stack))
    except Exception as e:  # the gateway's side of it, for the failure's report
        lines = [json.dumps(line) for line in stack.log_lines() if line.get("msg") == "request"]
        raise AssertionError(f"traffic failed ({e!r}); the gateway's request lines:\n"
                             + "\n".join(lines[-30:])) from e
    return stack


def test_every_dashboard_and_rule_metric_is_exported_live(traffic: Stack) -> None:
    stack = traffic
    gateway, replica = _exposition(stack.gateway), _exposition(stack.replica)
    recorded = {r["record"] for r in _rules() if "record" in r}
    referenced: set[str] = set()
    for expr in [*_dashboard_exprs(), *(r["expr"] for r in _rules())]:
        referenced |= metric_names(expr)
    referenced -= recorded | {"up"}  # `up` is Prometheus' own, for every target
    assert len(referenced) > 20
    # counted only under overload, which this traffic does not reach (flow control's bounds
    # are out of its reach): documented, so a renamed family is still caught
    unreached = {"kvgate_flow_shed_total"}
    assert unreached <= documented_kvgate_metrics().keys()
    missing = {n for n in referenced - unreached if not gateway.get(n) and not replica.get(n)}
    assert not missing, f"referenced but without samples in a live exposition: {missing}"


def test_gateway_exports_exactly_the_documented_families(traffic: Stack) -> None:
    stack = traffic
    text = httpx.get(f"{stack.gateway}/metrics", timeout=5).text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    documented = documented_kvgate_metrics()
    # prometheus_client names a counter family without its `_total` suffix
    exported = {(n + "_total" if t == "counter" else n): t for n, t in families.items()}
    assert exported == documented


def test_traffic_outcomes_are_counted(traffic: Stack) -> None:
    stack = traffic
    # a client that went away is counted when the gateway notices the disconnect and unwinds
    # the request, which can trail the client's cancel: wait for it, with a deadline
    deadline = time.monotonic() + DEADLINE_S
    while True:
        text = httpx.get(f"{stack.gateway}/metrics", timeout=5).text
        if 'status="499"' in text or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert 'kvgate_failovers_total{pool="b"}' in text
    assert 'kvgate_spillovers_total{from_pool="a",tier="premium",to_pool="b"}' in text
    # a 429, labelled by tier, tenant (an id while under the top-N cap) and limit
    assert re.search(r'kvgate_ratelimit_rejections_total\{limit="rpm",tenant="obs\d+-\w+",'
                     r'tier="free"\} 1', text)
    assert 'phase="relay"' in text and 'phase="pre_upstream"' in text
    outcomes = [line for line in text.splitlines() if line.startswith("kvgate_requests_total")]
    assert any('status="404"' in line for line in outcomes), outcomes
    assert any('status="499"' in line for line in outcomes), outcomes


def test_one_json_line_per_request_without_secrets(traffic: Stack) -> None:
    stack = traffic
    tid, key = stack.tenant("premium")
    rid = f"obs-{uuid.uuid4().hex}"
    assert asyncio.run(_chat(stack.client(key), "logged", stream=True, rid=rid))
    lines: list[dict[str, Any]] = []

    def logged() -> bool:
        lines[:] = [d for d in stack.log_lines() if d.get("request_id") == rid]
        return bool(lines)

    wait_for(logged, timeout=DEADLINE_S, what="the request's log line")
    (line,) = lines
    assert line["msg"] == "request" and line["level"] == "info"
    assert line["tenant"] == tid and line["tier"] == "premium"
    assert line["status"] == 200 and line["pool"] in {"a", "b"} and line["replica"] != "none"
    assert line["route"] and line["attempts"] >= 1 and line["model"] == MODEL
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] > 0
    assert 0 < line["ttft_ms"] <= line["total_ms"]
    text = Path(stack.proc._log.name).read_text(errors="replace")
    for secret in (PROMPT_MARK, key, AUTH_SECRET, ADMIN, "Bearer", "cache_salt", "lorem"):
        assert secret not in text, secret
