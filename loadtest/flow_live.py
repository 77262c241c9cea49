"""The flow control benchmark's live part (`loadtest.bench_flow --live`): two real gateways
on the same simulated replicas, flow control on and off, measured alternately (added latency
when nothing is saturated, kvgate's CPU per request), and the in-process cost of the fast path.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any

__all__ = ["fast_path_cost", "live_bench"]


def live_bench(quick: bool) -> dict[str, Any]:
    """Flow control on vs off on the same replicas: added latency unsaturated, CPU/request."""
    procs: list[subprocess.Popen[bytes]] = []
    lines: list[str] = []
    try:
        gws = _start(procs)
        lines += _latency(gws, quick)
        lines += _cpu(gws, quick)
        lines += ["", fast_path_cost()]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines.append(f"\nLoad average at the end: {load} on {os.cpu_count()} CPUs (other work "
                 "shared the machine when it is above ~1.5).")
    return {"text": "\n".join(lines)}


def _start(procs: list[subprocess.Popen[bytes]]) -> dict[str, tuple[str, int]]:
    """Two simulated replicas and a gateway in front of them per mode, flow control off and
    on (pinned to the last core), each started process added to ``procs`` as it starts:
    mode -> (URL, pid)."""
    from loadtest import bench_overhead as bo

    cores = sorted(os.sched_getaffinity(0))
    gw_core = {cores[-1]}
    urls = []
    for _ in range(2):
        port = bo._free_port()
        procs.append(subprocess.Popen(
            [*bo.KVGATE, "sim", "--host", "127.0.0.1", "--port", str(port), "--model",
             bo.MODEL, "--time-scale", "1000", "--max-num-seqs", "512", "--log-level",
             "warning"], stdout=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        bo._wait(f"{url}/health")
    gws: dict[str, tuple[str, int]] = {}
    for mode in ("off", "on"):
        port = bo._free_port()
        env = {**os.environ, "KVGATE_CONFIG": "",
               "KVGATE_FLOW__ENABLED": "true" if mode == "on" else "false"}
        cmd = [*bo.KVGATE, "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", "--no-auth"]
        cmd += [a for u in urls for a in ("--upstream", u)]
        p = subprocess.Popen(cmd, env=env, preexec_fn=bo._pinned(gw_core))
        procs.append(p)
        gws[mode] = (f"http://127.0.0.1:{port}", p.pid)
        bo._wait(f"{gws[mode][0]}/readyz")
    return gws


def _latency(gws: dict[str, tuple[str, int]], quick: bool) -> list[str]:
    """Added latency unsaturated: p50 and p99 at concurrency 1 and 8, off and on
    alternately in rounds, and how many requests queued meanwhile."""
    from loadtest import bench_overhead as bo

    rounds = 4 if quick else 8
    lat: dict[tuple[str, int], list[float]] = {}
    queued: dict[int, float] = {}
    levels = ((1, 800 if quick else 2000), (8, 1600 if quick else 4000))
    for conc, n in levels:
        q0 = _metric_sum(gws["on"][0], "kvgate_flow_queued_total")
        for _ in range(rounds):  # alternate, so drift in the machine's load hits both
            for mode in ("off", "on"):
                lvl = asyncio.run(bo.run_level([gws[mode][0]], False, conc, n // rounds))
                lat.setdefault((mode, conc), []).extend(lvl.total_ms)
        queued[conc] = _metric_sum(gws["on"][0], "kvgate_flow_queued_total") - q0
    lines = ["Two gateways on the same 2 simulated replicas (time-scale 1000: they answer "
             "at once), flow control off and on, no-auth, non-streamed 16-token chat; "
             "measured alternately in rounds. `queued`: requests that waited in the "
             "flow-control gateway's queue during the level (0: every request took the "
             "fast path, one saturation check and the narrowing of the views).\n",
             "| concurrency | p50 off (ms) | p50 on (ms) | added p50 (µs) | p99 off | "
             "p99 on | queued |", "|---|---|---|---|---|---|---|"]
    for conc, _n in levels:
        off, on = lat[("off", conc)], lat[("on", conc)]
        lines.append(f"| {conc} | {bo.pct(off, 0.5):.3f} | {bo.pct(on, 0.5):.3f} | "
                     f"{(bo.pct(on, 0.5) - bo.pct(off, 0.5)) * 1000:+.0f} | "
                     f"{bo.pct(off, 0.99):.3f} | {bo.pct(on, 0.99):.3f} | "
                     f"{queued[conc]:g} |")
    return lines


def _cpu(gws: dict[str, tuple[str, int]], quick: bool) -> list[str]:
    """kvgate's CPU per request at concurrency 8, off and on, twice each, alternately."""
    from loadtest import bench_overhead as bo

    n_cpu = 1500 if quick else 4000
    lines = ["", "CPU per request: concurrency 8 (not saturated), kvgate pinned to one "
             "core, measured twice each, alternately.\n",
             "| flow control | kvgate CPU µs/request | req/s | queued |", "|---|---|---|---|"]
    for _ in range(2):
        for mode in ("off", "on"):
            base, pid = gws[mode]
            q0 = _metric_sum(gws["on"][0], "kvgate_flow_queued_total")
            c0 = bo.cpu_seconds(pid)
            level = asyncio.run(bo.run_level([base], False, 8, n_cpu))
            cpu = bo.cpu_seconds(pid) - c0
            q = _metric_sum(gws["on"][0], "kvgate_flow_queued_total") - q0
            lines.append(f"| {mode} | {cpu / n_cpu * 1e6:.0f} | "
                         f"{n_cpu / level.wall_s:.0f} | {q:g} |")
    return lines


def _metric_sum(base: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def fast_path_cost() -> str:
    """In-process: the core's fast path on 8 replica views (saturation check + narrowing)."""
    import timeit

    from routing.flow import FlowConfig, PoolFlow
    from routing.types import ReplicaView

    flow: PoolFlow[object] = PoolFlow(FlowConfig())
    views = [ReplicaView(id=f"r{i}", pool="p", waiting=0.0, running=4.0, kv_usage=0.3,
                         cache_capacity_tokens=262_144, inflight=3,
                         inflight_prefill_tokens=2000) for i in range(8)]
    n = 20_000
    admit = timeit.timeit(lambda: flow.admit(views, 1000.0, 1.0), number=n) / n
    narrow = timeit.timeit(lambda: flow.with_room(views, {}, 1000), number=n) / n
    return (f"In-process cost of the fast path over 8 replicas: saturation check "
            f"{admit * 1e6:.1f} µs, narrowing the views {narrow * 1e6:.1f} µs per request.")
