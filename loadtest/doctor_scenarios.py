"""Fleets that are sick in one known way, for `kvgate doctor`'s tests and benchmark.

Each `Scenario` names the class the doctor must report and where (pool, and replica by its
index in the pool), the simulated replicas per pool (`kvgate sim` flags), the load per pool
(`doctor_load.Load`), runtime faults (``POST /sim/faults``), and whether Redis runs (and is
stopped after the load). `Running` starts it all on loopback: simulators, optionally
redis-server, and one gateway with an admin token; `report(window)` asks the doctor.

The simulator runs ``scale`` times faster than real time; the gateway's doctor samples every
``1/scale`` s and scrapes every ``250/scale`` ms (at most 4 and 10 times a second), so a
window of W wall seconds is W x scale seconds of a real fleet for the engine-side classes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from gateway.doctor import readiness
from loadtest.doctor_load import Load, LoadResult, run_load
from loadtest.fleet import Fleet, environ, free_port

__all__ = ["ADMIN_TOKEN", "SCENARIOS", "Running", "Scenario", "wrong_classes"]

ADMIN_TOKEN = "doctor-scenario-admin-token-0123"  # loopback tests and benchmarks only
SALT_SECRET = "doctor-scenario-salt-secret-0123456789"  # idem


@dataclass
class Scenario:
    name: str
    expect: str  # the class the doctor must name
    pool: str  # where: this pool ...
    replica: int | None  # ... and its replica with this index (None: the pool itself)
    pools: dict[str, list[list[str]]]  # pool -> one `kvgate sim` flag list per replica
    loads: dict[str, Load]  # pool -> its load (model names are filled in)
    faults: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    routing: dict[str, Any] = field(default_factory=dict)
    flow: dict[str, Any] | None = None  # flow control on, with these settings
    redis: bool = False
    stop_redis: bool = False  # stop Redis once the load has run
    gateway_proof: bool = False  # a "gateway" finding is the subject: never count it wrong
    # (tenant, pool, load): loads sent with that tenant's API key; any of them turns
    # authentication on (tenants bootstrapped from the config, keys from the admin API)
    tenant_loads: list[tuple[str, str, Load]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # more of the gateway's config
    redis_password: str = ""  # put in KVGATE_REDIS_URL (a Redis without requirepass refuses it)
    says: str = ""  # a phrase the expected finding's summary or action must hold
    readyz: bool = False  # report as `kvgate doctor` does: /readyz's reasons merged in


def _pool(flags: list[str], n: int = 1) -> list[list[str]]:
    return [list(flags) for _ in range(n)]


A100 = ["--preset", "a100-70b-awq"]
OK_POOL = {"ok": _pool([])}
OK_LOAD = {"ok": Load("", 1, "short", max_tokens=20)}

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("healthy", "healthy", "p", None, {"p": _pool([], 2)},
             {"p": Load("", 2, "short", max_tokens=32)}),
    # the routes beside chat (Anthropic messages, count_tokens, rerank, score, tokenize,
    # pooling, audio uploads) beside chat: no first token to time, nothing to name
    Scenario("healthy-routes", "healthy", "p", None, {"p": _pool([], 2), **OK_POOL},
             {"p": Load("", 3, "routes"), **OK_LOAD}),
    Scenario("queue-bound", "queue-bound", "q", 0,
             {"q": _pool(["--max-num-seqs", "4"]), **OK_POOL},
             {"q": Load("", 16, "short", max_tokens=400), **OK_LOAD}),
    Scenario("kv-bound", "KV-bound", "kv", 0,
             {"kv": _pool(["--num-gpu-blocks", "40", "--max-model-len", "2048"]), **OK_POOL},
             {"kv": Load("", 12, "long-unique", 200, max_tokens=600), **OK_LOAD}),
    Scenario("prefill-bound", "prefill-bound", "pf", 0, {"pf": _pool(A100), **OK_POOL},
             {"pf": Load("", 1, "long-unique", 3000, max_tokens=8), **OK_LOAD}),
    Scenario("decode-bound", "decode-bound", "dec", 0, {"dec": _pool(A100), **OK_POOL},
             {"dec": Load("", 96, "short", max_tokens=600), **OK_LOAD}),
    Scenario("imbalance", "routing", "p", 0, {"p": _pool([], 2)},
             {"p": Load("", 16, "short", max_tokens=50)},
             faults={("p", 0): {"latency_ms": 300.0}}),
    Scenario("slow-replica", "routing", "p", 1, {"p": [[], A100]},
             {"p": Load("", 8, "short", max_tokens=100)}, routing={"policy": "round_robin"}),
    # an engine 2x slower than its two peers' (`kvgate sim --slowdown`), cache-aware routing
    # sending it less: no in-flight or time-per-request spread to see
    Scenario("slow-engine", "routing", "p", 0, {"p": [["--slowdown", "2"], [], []]},
             {"p": Load("", 12, "short", max_tokens=100)}),
    Scenario("hit-rate", "routing", "p", None, {"p": _pool([], 2)},
             {"p": Load("", 1, "pairs", 1500, max_tokens=4)},
             routing={"policy": "round_robin"}),
    Scenario("flow-queue", "queue-bound", "q", None, {"q": _pool([]), **OK_POOL},
             {"q": Load("", 24, "short", max_tokens=200), **OK_LOAD},
             flow={"max_inflight": 4}),
    # a replica started with another model (a wrong Service selector, a rollout of another
    # model): its /health says 200, kvgate takes it out for what its /v1/models lists
    Scenario("wrong-model", "down", "p", 1, {"p": [[], ["--model", "m-other"]], **OK_POOL},
             {"p": Load("", 4, "short", max_tokens=16), **OK_LOAD}),
    # prompts longer than the replicas' --max-model-len: every request answered vLLM's 400
    Scenario("context-too-long", "errors", "p", None,
             {"p": _pool(["--max-model-len", "1024"], 2), **OK_POOL},
             {"p": Load("", 4, "long-unique", 1500, max_tokens=16), **OK_LOAD}),
    # a tenant sending more than its tier's rpm: kvgate's 429s, before any pool sees them
    Scenario("rate-limited", "limits", "", None, {"p": _pool([], 2)}, {},
             tenant_loads=[("t1", "p", Load("", 4, "short", max_tokens=16))],
             config={"tiers": {"default": {"limits": {"rpm": 60}}}}),
    Scenario("redis-down", "gateway", "", None, {"p": _pool([], 2)},
             {"p": Load("", 2, "short", max_tokens=16)}, redis=True, stop_redis=True,
             gateway_proof=True),
    # today's faults (loadtest/results/bench_doctor_doctor6.md): an engine hung on a replica
    # without engine counters, found stalled on kvgate's own evidence (its streams wait)
    Scenario("blind-stall", "down", "p", 0,
             {"p": [["--disable-log-stats"], []]},
             {"p": Load("", 4, "short", max_tokens=16, stream=True)},
             faults={("p", 0): {"engine_hang": True}}, routing={"policy": "round_robin"},
             config={"health": {"interval_s": 0.5, "stall_after_s": 2, "eject_base_s": 30}},
             says="no engine counters", gateway_proof=True),
    # the same hang seen before its ejection (obs7): nothing but kvgate's own requests waiting
    # there for a first token, nothing returned (kvgate_replica_oldest_wait_seconds); named
    # after hung_s (3 s here), before health.stall_after_s (8 s) ejects it
    Scenario("blind-wait", "down", "p", 0,
             {"p": [["--disable-log-stats"], []]},
             {"p": Load("", 4, "short", max_tokens=16, stream=True)},
             faults={("p", 0): {"engine_hang": True}}, routing={"policy": "round_robin"},
             config={"health": {"interval_s": 0.5, "stall_after_s": 8, "eject_base_s": 30},
                     "doctor": {"interval_s": 0.25, "thresholds": {"hung_s": 3}}},
             says="waiting for a first token", gateway_proof=True),
    # KVGATE_REDIS_URL with a password for a Redis that has none: the shared routing state
    # is refused ("AUTH ... called without any password configured", cause `other`)
    Scenario("redis-password", "gateway", "", None, {"p": _pool([], 2)},
             {"p": Load("", 2, "short", max_tokens=16)}, redis=True,
             redis_password="doctor-scenario-unneeded-password", says="requirepass",
             readyz=True),
    Scenario("scrape-failing", "gateway", "p", 1,
             {"p": [[], ["--disable-log-stats"]]},
             {"p": Load("", 2, "short", max_tokens=16)}, gateway_proof=True),
)}


def model_of(pool: str) -> str:
    return f"m-{pool}"


def replica_id(url: str) -> str:
    return url.removeprefix("http://")


class Running:
    """A scenario's processes on loopback (a context manager)."""

    def __init__(self, sc: Scenario, scale: float = 20.0, thresholds: dict[str, float] | None
                 = None, quiet: bool = True, config: dict[str, Any] | None = None) -> None:
        self.sc = sc
        self.scale = scale
        self.fleet = Fleet(quiet=quiet)
        self.urls: dict[str, list[str]] = {}
        self.base = ""
        self.redis: subprocess.Popen[bytes] | None = None
        self.redis_url = ""
        self.keys: dict[str, str] = {}  # tenant -> API key
        self._thresholds = thresholds or {}
        self._config = config or {}
        self._path = ""

    def __enter__(self) -> Running:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        sc, scale = self.sc, self.scale
        for pool, replicas in sc.pools.items():
            self.urls[pool] = [self.fleet.sim(model_of(pool), "--time-scale", f"{scale:g}",
                                              *flags) for flags in replicas]
        for (pool, i), faults in sc.faults.items():
            r = httpx.post(f"{self.urls[pool][i]}/sim/faults", json=faults, timeout=5)
            r.raise_for_status()
        cfg: dict[str, Any] = {
            "pools": {p: {"served_model": model_of(p), "replicas": urls}
                      for p, urls in self.urls.items()},
            "routing": {"scrape_interval_ms": max(100, round(250 / scale)), **sc.routing},
            "doctor": {"interval_s": max(0.25, round(1.0 / scale, 3)),
                       "thresholds": self._thresholds},
            "health": {"interval_s": 0.5},
            **({"flow": {"enabled": True, **sc.flow}} if sc.flow is not None else {}),
            **sc.config, **self._config,
        }
        tenants = sorted({t for t, _, _ in sc.tenant_loads})
        if tenants:
            cfg["tenants"] = [{"id": t} for t in tenants]
        fd, self._path = tempfile.mkstemp(prefix="kvgate-doctor-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f)
        if sc.redis:
            self._start_redis()
        self.base = self.gateway()
        for tenant in tenants:
            r = httpx.post(f"{self.base}/admin/tenants/{tenant}/keys", timeout=10,
                           headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
            r.raise_for_status()
            self.keys[tenant] = r.json()["key"]

    def gateway(self) -> str:
        """Start a gateway on the scenario's config (a second one shares Redis, when the
        scenario runs it, with the first); returns its base URL."""
        tenants = bool(self.sc.tenant_loads)
        env = {"KVGATE_ADMIN_TOKEN": ADMIN_TOKEN, "KVGATE_CONFIG": "",
               "KVGATE_REDIS_URL": self.redis_url, "KVGATE_SALT_SECRET": SALT_SECRET if tenants
               else ""}
        port = free_port()
        with environ(env):
            auth = [] if tenants else ["--no-auth"]
            self.fleet.start(["serve", *auth, "--host", "127.0.0.1", "--port", str(port),
                              "--config", self._path], f"http://127.0.0.1:{port}/readyz")
        return f"http://127.0.0.1:{port}"

    def _start_redis(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed; run scripts/setup")
        port = free_port()
        self.redis = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        auth = f":{self.sc.redis_password}@" if self.sc.redis_password else ""
        self.redis_url = f"redis://{auth}127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop_redis(self) -> None:
        if self.redis is not None and self.redis.poll() is None:
            self.redis.send_signal(signal.SIGTERM)
            self.redis.wait(10)

    def __exit__(self, *exc: object) -> None:
        self.fleet.stop()
        self.stop_redis()
        if self._path:
            os.unlink(self._path)
            self._path = ""

    # -- use ------------------------------------------------------------------------------------
    def loads(self) -> list[Load]:
        out = []
        for pool, load in self.sc.loads.items():
            out.append(Load(model_of(pool), load.concurrency, load.kind, load.prompt_tokens,
                            load.max_tokens, load.api_key, load.stream))
        for tenant, pool, load in self.sc.tenant_loads:
            out.append(Load(model_of(pool), load.concurrency, load.kind, load.prompt_tokens,
                            load.max_tokens, self.keys[tenant]))
        return out

    def run(self, duration_s: float, during: Callable[[float], None] | None = None,
            poll_s: float = 0.5) -> list[LoadResult]:
        """Run the load for ``duration_s``; ``during(elapsed)`` is called about every
        ``poll_s`` from a thread while it runs (the benchmark polls the doctor there)."""
        stop = [False]

        async def main() -> list[LoadResult]:
            start = time.monotonic()

            async def poll() -> None:
                while not stop[0] and during is not None:
                    await asyncio.sleep(poll_s)
                    await asyncio.to_thread(during, time.monotonic() - start)

            poller = asyncio.create_task(poll())
            try:
                return await run_load(self.base, self.loads(), duration_s, tag=self.sc.name)
            finally:
                stop[0] = True
                await poller

        return asyncio.run(main())

    def report(self, window_s: float, base: str = "") -> dict[str, Any]:
        """The doctor's report of this scenario's gateway (or of the one at ``base``)."""
        r = httpx.get(f"{base or self.base}/admin/doctor", params={"window": f"{window_s:g}s"},
                      headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        if self.sc.readyz:  # what `kvgate doctor` adds from the gateway's /readyz
            page = httpx.get(f"{base or self.base}/readyz", timeout=30)
            readiness.merge(out, readiness.from_readyz(base or self.base, page.status_code,
                                                       page.content, out["findings"]))
        return out

    def target(self) -> tuple[str | None, str | None]:
        """(pool, replica id) where the expected finding belongs."""
        sc = self.sc
        if not sc.pool:
            return None, None
        if sc.replica is None:
            return sc.pool, None
        return sc.pool, replica_id(self.urls[sc.pool][sc.replica])


def wrong_classes(report: dict[str, Any], sc: Scenario, target: tuple[str | None, str | None],
                  ignore_gateway_overhead: bool = False) -> list[str]:
    """Findings that are neither the expected one at the target nor healthy."""
    out = []
    for f in report["findings"]:
        if f["class"] == "healthy":
            continue
        if f["class"] == sc.expect and (f["pool"], f["replica"]) == target:
            continue
        if sc.gateway_proof and f["class"] == "gateway":
            continue
        if ignore_gateway_overhead and f["class"] == "gateway" and f["pool"] is None \
                and "before the upstream request" in f["summary"]:
            continue
        out.append(f"{f['class']}@{f['pool']}/{f['replica']}")
    return out


def found(report: dict[str, Any], sc: Scenario, target: tuple[str | None, str | None]) -> bool:
    """Whether the expected class is named at the target (healthy: nothing else anywhere)."""
    if sc.expect == "healthy":
        return all(f["class"] == "healthy" for f in report["findings"])
    return any(f["class"] == sc.expect and (f["pool"], f["replica"]) == target
               and sc.says in f["summary"] + " " + f["action"] for f in report["findings"])
