"""Gray failures: one of four replicas is not dead but wrong; what do kvgate's clients see?

    python -m loadtest.gray_failures [--quick] [--only NAME ...] [--conversations 24]
                                     [--out loadtest/results/gray_failures.md]

Four simulated replicas (`kvgate sim`), one gateway (`kvgate serve --config`, cache_aware)
and conversations with shared prefixes through the official openai client (async, streamed
and not, no client retries: `loadtest.gray_load`). Per scenario two runs, one after the
other, with the same load: `kvgate` (all four replicas, the first one faulty from
`pre_s` to `pre_s + fault_s`, then its faults lifted with ``POST /sim/faults``) and
`baseline` (the faulty replica left out of the config, the same fault timeline). Printed per
run: success rate, errors by status, TTFT p50/p99 (during the fault), the faulty replica's
share of the requests per phase and per 2 s bucket, when kvgate ejected it
(`kvgate_replica_healthy` 0, polled every 0.2 s) and took it back after the fault was lifted,
retries by reason, requests still in flight at the end, tracebacks in the gateway's log, and
what `kvgate doctor` said (its findings other than healthy) at the end of the fault.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.cmdline import shown_command
from loadtest.fleet import KVGATE, free_port, wait_http
from loadtest.gray_load import Load, run_conversations
from loadtest.gray_report import Run, render

__all__ = ["SCENARIOS", "Scenario", "main"]

MODEL = "gray-model"
ADMIN_TOKEN = "gray-failures-admin-token-0123456"  # loopback benchmark only
NORMAL: dict[str, Any] = {
    "latency_ms": 0, "error_rate": 0.0, "drop_connections": False, "health_latency_ms": 0,
    "hang_after_tokens": -1, "metrics_latency_ms": 0, "metrics_status": 0,
    "kv_usage_zero": False, "engine_hang": False}


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    faults: dict[str, Any]
    flap_s: float = 0.0  # > 0: the faults go on and off every flap_s (intermittent)
    sim_flags: tuple[str, ...] = ()  # its own four replicas, started with these flags
    health: dict[str, Any] = field(default_factory=dict)  # the gateway's `health` settings
    # its process is stopped (SIGSTOP) for the fault and resumed (SIGCONT) after, instead of
    # `faults`: connections stay open, nothing answers, not /health nor /metrics
    freeze: bool = False


SCENARIOS = {s.name: s for s in (
    Scenario("slow", "(1) 5x slower: 250 ms added before each request's engine, /health fine",
             {"latency_ms": 250}),
    Scenario("metrics-hang", "(2a) /metrics answers after 5 s (scrapes time out), serves fine",
             {"metrics_latency_ms": 5000}),
    Scenario("metrics-500", "(2b) /metrics answers 500, serves fine", {"metrics_status": 500}),
    Scenario("hang-mid-stream", "(3) streams hang after 4 tokens (--hang-after-tokens 4)",
             {"hang_after_tokens": 4}),
    Scenario("errors-20", "(4) 20 % of requests answer 500 (--error-rate 0.2)",
             {"error_rate": 0.2, "error_status": 500}),
    Scenario("drop-connections", "(5) drops connections, 1 s on / 1 s off",
             {"drop_connections": True}, flap_s=1.0),
    Scenario("slow-health", "(6) /health answers after 6 s (timeout 5 s), serves fine",
             {"health_latency_ms": 6000}),
    Scenario("kv-lies", "(7) its KV usage gauge says 0 whatever it holds (caches of 40 "
             "blocks: the others' KV is near full)", {"kv_usage_zero": True},
             sim_flags=("--num-gpu-blocks", "40", "--max-model-len", "2048")),
    # (the default 60 s would outlast the 30 s fault: the simulator's prefills take ms)
    Scenario("engine-hang", "(8) its engine stops stepping (--engine-hang): no token for any "
             "request, /health and /metrics 200; health.stall_after_s 5",
             {"engine_hang": True}, health={"stall_after_s": 5}),
    Scenario("frozen", "(9) its process is stopped (SIGSTOP): connections open, nothing answers, "
             "not /health nor /metrics", {}, freeze=True),
)}


@dataclass
class Phases:
    pre_s: float
    fault_s: float
    post_s: float

    @property
    def end_s(self) -> float:
        return self.pre_s + self.fault_s + self.post_s


@dataclass
class Fleet:
    sims: list[str] = field(default_factory=list)
    flags: tuple[str, ...] = ()  # the sims' flags
    sim_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, args: list[str], probe: str,
              log: Path | None = None) -> subprocess.Popen[bytes]:
        if log is None:
            proc = subprocess.Popen([*KVGATE, *args], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        else:
            with log.open("wb") as out:  # the child keeps its own descriptor
                proc = subprocess.Popen([*KVGATE, *args], stdout=out, stderr=out)
        self.procs.append(proc)
        if not wait_http(probe, 60):
            raise RuntimeError(f"not ready: {probe}")
        return proc

    def sim(self, *flags: str) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.sim_procs[url] = self.start(
            ["sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, *flags],
            f"{url}/health")
        return url

    def stop_sims(self) -> None:
        for url in self.sims:
            self.stop(self.sim_procs.pop(url))
        self.sims = []

    def stop(self, proc: subprocess.Popen[bytes] | None = None) -> None:
        for p in [proc] if proc is not None else list(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            self.procs.remove(p)


def _config(path: Path, replicas: list[str], policy: str, health: dict[str, Any]) -> None:
    cfg = {"server": {"log_level": "warning"},
           "pools": {"p": {"served_model": MODEL, "replicas": replicas}},
           "routing": {"policy": policy},
           "upstream": {"idle_timeout_s": 10},
           "doctor": {"interval_s": 1.0},
           **({"health": health} if health else {})}
    path.write_text(yaml.safe_dump(cfg))


def _gauges(text: str, name: str) -> dict[str, float]:
    """replica id -> value of gauge `name` (pool p)."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^{name}\{{[^}}]*replica="([^"]+)"[^}}]*\}} (\S+)$', text, re.M)}


def _retries(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^kvgate_upstream_retries_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


async def _faults(url: str, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        (await c.post(f"{url}/sim/faults", json=body)).raise_for_status()


async def _timeline(run: Run, base: str, faulty: str, ph: Phases, sc: Scenario,
                    t0: float, pid: int) -> None:
    """Inject and lift the fault on schedule, poll the gateway's health gauge, ask the doctor.
    `pid`: the faulty replica's process (`Scenario.freeze`)."""
    rid = faulty.removeprefix("http://")
    async with httpx.AsyncClient(timeout=10) as c:
        fault_on, next_flap, flap_on = False, 0.0, True
        while (now := time.monotonic() - t0) < ph.end_s:
            if not fault_on and ph.pre_s <= now < ph.pre_s + ph.fault_s:
                if sc.freeze:
                    os.kill(pid, signal.SIGSTOP)
                else:
                    await _faults(faulty, sc.faults)
                fault_on, next_flap = True, now + sc.flap_s
            if fault_on and sc.flap_s and now >= next_flap and now < ph.pre_s + ph.fault_s:
                flap_on = not flap_on
                await _faults(faulty, sc.faults if flap_on else NORMAL)
                next_flap = now + sc.flap_s
            if fault_on and now >= ph.pre_s + ph.fault_s:
                if run.doctor is None:
                    run.doctor = await _doctor(base, ph.fault_s)
                if sc.freeze:
                    os.kill(pid, signal.SIGCONT)
                await _faults(faulty, NORMAL)
                fault_on = False
            try:
                text = (await c.get(f"{base}/metrics")).text
                healthy = _gauges(text, "kvgate_replica_healthy").get(rid)
                if healthy is not None:
                    run.health.append((now, healthy))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        await _faults(faulty, NORMAL)


async def _doctor(base: str, window_s: float) -> list[str]:
    proc = await asyncio.create_subprocess_exec(
        *KVGATE, "doctor", "--url", base, "--admin-token", ADMIN_TOKEN,
        "--window", f"{int(window_s)}s", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        return [f"doctor failed: {err.decode().strip()[:200]}"]
    report = json.loads(out)
    return [f"{f['severity']} {f['class']}@{f['replica'] or f['pool'] or 'gateway'}: "
            f"{f['summary'][:110]}" for f in report["findings"] if f["class"] != "healthy"]


def _one_run(fleet: Fleet, tmp: Path, sc: Scenario, variant: str, ph: Phases,
             conversations: int) -> Run:
    faulty = fleet.sims[0]
    replicas = fleet.sims if variant != "baseline" else fleet.sims[1:]
    policy = "least_load" if variant == "least_load" else "cache_aware"
    cfg = tmp / f"{sc.name}-{variant}.yaml"
    _config(cfg, replicas, policy, sc.health)
    log = tmp / f"{sc.name}-{variant}.log"
    port = free_port()
    os.environ["KVGATE_ADMIN_TOKEN"] = ADMIN_TOKEN
    gw = fleet.start(["serve", "--no-auth", "--host", "127.0.0.1", "--port", str(port),
                      "--config", str(cfg)], f"http://127.0.0.1:{port}/readyz", log)
    base = f"http://127.0.0.1:{port}"
    run = Run(sc.name, variant, faulty.removeprefix("http://"), ph.pre_s, ph.fault_s)
    load = Load(base, MODEL, conversations)

    async def go() -> None:
        t0 = time.monotonic()
        await asyncio.gather(run_conversations(load, ph.end_s, t0),
                             _timeline(run, base, faulty, ph, sc, t0, pid))

    pid = fleet.sim_procs[faulty].pid
    try:
        asyncio.run(go())
        time.sleep(1.5)  # in-flight requests end; then the counters must be back at 0
        text = httpx.get(f"{base}/metrics", timeout=10).text
        run.inflight_after = sum(_gauges(text, "kvgate_inflight_requests").values())
        run.retries = _retries(text)
    finally:
        if sc.freeze:
            os.kill(pid, signal.SIGCONT)  # (the run stopped early)
        fleet.stop(gw)
    run.records = load.records
    run.tracebacks = log.read_text(errors="replace").count("Traceback")
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gray_failures", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="phases of 3 s / 10 s / 8 s instead of 4 s / 30 s / 16 s")
    p.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="these scenarios")
    p.add_argument("--variants", default="baseline,kvgate",
                   help="comma-separated: baseline, kvgate, least_load (all four, least_load)")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--out", help="write the Markdown report here")
    args = p.parse_args(argv)
    ph = Phases(3, 10, 8) if args.quick else Phases(4, 30, 16)
    names = args.only or list(SCENARIOS)
    fleet = Fleet()
    runs: list[Run] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvgate-gray-") as tmp:
            for name in names:
                flags = SCENARIOS[name].sim_flags
                if not fleet.sims or flags != fleet.flags:
                    fleet.stop_sims()
                    fleet.sims = [fleet.sim(*flags) for _ in range(4)]
                    fleet.flags = flags
                for variant in args.variants.split(","):
                    run = _one_run(fleet, Path(tmp), SCENARIOS[name], variant, ph,
                                   args.conversations)
                    runs.append(run)
                    print(f"# {name} {variant}: {run.line()}", file=sys.stderr, flush=True)
    finally:
        fleet.stop()
    text = render(runs, {n: SCENARIOS[n].what for n in names},
                  shown_command("loadtest.gray_failures", argv), ph.pre_s, ph.fault_s)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
