"""Benchmark of the vLLM simulator itself: is it ever the bottleneck?

    python -m loadtest.bench_sim [--seconds 3]

1. Server cost: a `kvgate sim` pinned to one core (time-scale 1000, so the modelled GPU is never
   the limit) is driven by a closed-loop aiohttp client pinned elsewhere; we report requests/s and
   the simulator's CPU time per request (from /proc), i.e. its max rate on one core.
2. Fidelity: p50 |TTFT measured by a streaming client - TTFT of the cost model| at low load
   (time-scale 1, one request at a time, uncached prompts).
3. Engine alone: simulated seconds per wall second for an offline replay-like load (one replica's
   share of 12k requests/hour over 8 replicas: mean 12k prompt tokens, mean 343 output tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import subprocess
import sys
import time

import aiohttp

from loadtest.sim.costmodel import get_preset
from loadtest.sim.engine import Engine
from loadtest.sim.spec import EngineConfig, RequestSpec
from routing.tokens import count_tokens

PRESET = "h100-8b-fp8"


def _start_sim(port: int, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), "--model", "m", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.sched_setaffinity(proc.pid, {0})
    return proc


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("simulator did not start")


async def _closed_loop(url: str, body: dict[str, object], seconds: float, conc: int) -> int:
    done = 0
    deadline = time.monotonic() + seconds

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            async with s.post(f"{url}/v1/completions", json=body) as r:
                await r.read()
                done += r.status == 200

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(worker(s) for _ in range(conc)))
    return done


async def bench_server(seconds: float) -> None:
    port = 19400 + os.getpid() % 500
    proc = _start_sim(port, "--time-scale", "1000")
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(url)
        for label, body in (
            ("non-stream, 8-token prompt, 1 token", {"model": "m", "prompt": "x" * 32,
                                                     "max_tokens": 1}),
            ("stream, 8-token prompt, 16 tokens", {"model": "m", "prompt": "y" * 32,
                                                   "max_tokens": 16, "ignore_eos": True,
                                                   "stream": True}),
        ):
            cpu0, t0 = _cpu_seconds(proc.pid), time.monotonic()
            n = await _closed_loop(url, body, seconds, 32)
            cpu, wall = _cpu_seconds(proc.pid) - cpu0, time.monotonic() - t0
            print(f"  {label:<38} {n / wall:7.0f} req/s   sim CPU {cpu / n * 1e6:6.0f} us/req"
                  f"  -> max ~{n / cpu:6.0f} req/s on one core")
    finally:
        proc.terminate()
        proc.wait(10)


async def bench_ttft(n: int) -> None:
    port = 19900 + os.getpid() % 90
    proc = _start_sim(port, "--time-scale", "1", "--preset", PRESET)
    url = f"http://127.0.0.1:{port}"
    cost = get_preset(PRESET).cost
    errors, rel = [], []
    try:
        await _wait_ready(url)
        async with aiohttp.ClientSession() as s:
            for i in range(n):
                prompt = f"{i:08d} " + "z" * random.Random(i).randrange(400, 8000)
                tokens = count_tokens(len(prompt))
                expected = cost.step_time(tokens, 0, tokens)
                body = {"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True}
                t0 = time.perf_counter()
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.content.readline()
                    ttft = time.perf_counter() - t0
                    await r.read()
                errors.append(ttft - expected)
                rel.append((ttft - expected) / expected)
    finally:
        proc.terminate()
        proc.wait(10)
    abs_err = sorted(abs(e) for e in errors)
    print(f"  {n} sequential requests, 100-2000 prompt tokens, model TTFT 10-86 ms:")
    print(f"  p50 |error| {statistics.median(abs_err) * 1e3:.2f} ms, p90 "
          f"{abs_err[int(0.9 * len(abs_err))] * 1e3:.2f} ms; median error "
          f"{statistics.median(errors) * 1e3:+.2f} ms ({statistics.median(rel) * 100:+.1f}%)")


def bench_engine() -> None:
    preset = get_preset(PRESET)
    engine = Engine(EngineConfig(cost=preset.cost, num_gpu_blocks=preset.num_gpu_blocks))
    rng = random.Random(7)
    t = 0.0
    t0 = time.perf_counter()
    for i in range(1500):  # one of 8 replicas' share of 12k requests in an hour
        t += rng.expovariate(1500 / 3600)
        prompt = min(30_000, max(32, int(rng.expovariate(1 / 12_000))))
        shared = prompt // 32  # half of the blocks come from one of 50 shared prefixes
        group = rng.randrange(50)
        hashes = tuple(hash((group, j)) if j < shared else hash((i, j)) for j in
                       range(prompt // 16))
        out = min(max(1, int(rng.expovariate(1 / 343))), 32_768 - prompt)
        engine.advance(t)
        engine.add_request(RequestSpec(str(i), hashes, prompt, out), t)
    engine.advance(math.inf)
    wall = time.perf_counter() - t0
    s = engine.stats
    print(f"  1500 requests, {engine.now:.0f} simulated s in {wall:.2f} wall s "
          f"({engine.now / wall:,.0f} sim-s per wall-s); {s.steps:,} steps of which "
          f"{s.fast_forwarded_steps / s.steps:.0%} fast-forwarded")
    print(f"  -> 8 such replicas (12k requests, 1 h) ~ {8 * wall:.1f} s of engine time")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_sim", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--ttft-requests", type=int, default=40)
    args = p.parse_args(argv)
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[1:]))  # client off core 0
    print("1. simulator server cost (sim pinned to core 0, time-scale 1000)")
    asyncio.run(bench_server(args.seconds))
    print("2. TTFT vs cost model at low load (time-scale 1)")
    asyncio.run(bench_ttft(args.ttft_requests))
    print("3. engine alone, offline fast-forward")
    bench_engine()
    return 0


if __name__ == "__main__":
    sys.exit(main())
