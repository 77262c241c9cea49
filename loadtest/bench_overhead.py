"""The gateway-overhead benchmark: simulated replicas directly vs through kvgate, in one run.

    python -m loadtest.bench_overhead [--quick] [--memory-minutes 10]

kvgate runs pinned to one core (the last one); the load generator and the simulated replicas
share the other core(s). A bare aiohttp pass-through (`loadtest.bare_proxy`) runs pinned to
the same core as the reference. Printed and written to ``loadtest/results/bench_overhead.md``:

- CPU time per proxied request of kvgate and of the bare pass-through, from each process's
  utime+stime (``/proc``) over a saturating run at concurrency 16 and 128, non-streamed and
  streamed (16-token responses), and their ratio;
- requests/s at saturation, direct and through kvgate;
- p50/p99 latency direct and what the bare pass-through and kvgate add to it, at concurrency
  1, 32 and 256, streamed and not; for streams also time to first token (the first SSE event);
- with ``--memory-minutes N``: kvgate's RSS sampled over an N-minute run under load;
- with ``--granian`` (granian installed): the same app under granian (a Rust ASGI server)
  beside uvicorn+httptools, CPU per request.

The simulated replicas run far faster than real time, so the upstream answers quickly and the
gateway's cost is a visible part of each request. The load generator is aiohttp, closed loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson

__all__ = ["main"]

MODEL = "bench-model"
ADMIN = secrets.token_hex(16)  # the admin token of the gateway under test (--auth runs)
RESULTS = Path(__file__).resolve().parent / "results" / "bench_overhead.md"
KVGATE = [sys.executable, "-m", "gateway.cli"]
TOKENS = 16
UPSTREAM_MS = 100  # replica think time in the latency runs ...
JITTER_MS = 100  # ... plus 0-100 ms, fixed per prompt (identical direct and via kvgate)
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Level:
    """Latencies of one (target, stream, concurrency) run."""

    total_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- processes ---------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pinned(cores: set[int]) -> Callable[[], None]:
    return lambda: os.sched_setaffinity(0, cores)


def _wait(url: str, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"not ready: {url}")


@dataclass
class Procs:
    sims: list[str]
    gateway: str
    gateway_pid: int
    bare: str
    bare_pid: int
    headers: dict[str, str]  # what kvgate's requests carry (an API key with --auth)
    core: int  # the core kvgate and the bare pass-through are pinned to


@contextmanager
def processes(replicas: int, time_scale: float, auth: bool = False) -> Iterator[Procs]:
    """Start replicas (load cores), kvgate and the bare pass-through (both on the last core).
    With `auth`, kvgate authenticates every request (in-memory store) and the headers carry
    a key made for a bench tenant through the admin API."""
    cores = sorted(os.sched_getaffinity(0))
    gw_core, load_cores = {cores[-1]}, set(cores[:-1]) or {cores[-1]}
    os.sched_setaffinity(0, load_cores)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for _ in range(replicas):
            port = _free_port()
            cmd = [*KVGATE, "sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                   "--time-scale", str(time_scale), "--max-num-seqs", "512", "--log-level",
                   "warning"]
            procs.append(subprocess.Popen(cmd, preexec_fn=_pinned(load_cores),
                                          stdout=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            _wait(f"{url}/health")
        port = _free_port()
        cmd = [*KVGATE, "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning"] + [arg for url in urls for arg in ("--upstream", url)]
        env = {**os.environ, "KVGATE_CONFIG": ""}
        if auth:
            env |= {"KVGATE_SALT_SECRET": secrets.token_hex(32), "KVGATE_ADMIN_TOKEN": ADMIN}
        else:
            cmd.append("--no-auth")
        gw = subprocess.Popen(cmd, preexec_fn=_pinned(gw_core), env=env)
        procs.append(gw)
        base = f"http://127.0.0.1:{port}"
        bare_port = _free_port()
        bare = subprocess.Popen([sys.executable, "-m", "loadtest.bare_proxy", str(bare_port),
                                 *urls], preexec_fn=_pinned(gw_core))
        procs.append(bare)
        bare_base = f"http://127.0.0.1:{bare_port}"
        _wait(f"{base}/readyz")
        _wait(f"{bare_base}/readyz")
        yield Procs(urls, base, gw.pid, bare_base, bare.pid,
                    _bench_key(base) if auth else {}, cores[-1])
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)


def _bench_key(base: str) -> dict[str, str]:
    """A tenant and an API key for the load generator, made through the admin API."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    httpx.post(f"{base}/admin/tenants", json={"id": "bench", "tier": "default"},
               headers=admin, timeout=10).raise_for_status()
    resp = httpx.post(f"{base}/admin/tenants/bench/keys", headers=admin, timeout=10)
    resp.raise_for_status()
    return {"Authorization": f"Bearer {resp.json()['key']}"}


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its children (granian serves from a child process)."""
    total = 0.0
    for one in (pid, *_children(pid)):
        try:
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone
            continue
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``: each thread's /proc children list, else (a kernel without
    it) a scan of every process's parent."""
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    except OSError:
        pass
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- load --------------------------------------------------------------------------------------
def body(stream: bool, i: int) -> bytes:
    return orjson.dumps({
        "model": MODEL, "max_tokens": TOKENS, "ignore_eos": True, "stream": stream,
        "messages": [{"role": "user", "content": f"Request {i}: say something short."}],
    })


async def one(
    session: aiohttp.ClientSession, url: str, stream: bool, i: int, out: Level,
    headers: dict[str, str],
) -> None:
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body(stream, i),
                                headers={"Content-Type": "application/json", **headers}) as resp:
            if stream:
                first = await resp.content.readany()
                out.ttft_ms.append((time.perf_counter() - t0) * 1000)
                while first:
                    first = await resp.content.readany()
            else:
                await resp.read()
            if resp.status != 200:
                out.errors += 1
                return
    except aiohttp.ClientError:
        out.errors += 1
        return
    out.total_ms.append((time.perf_counter() - t0) * 1000)


async def run_level(
    bases: list[str], stream: bool, concurrency: int, n: int,
    headers: dict[str, str] | None = None,
) -> Level:
    """Closed loop: `concurrency` workers, `n` requests spread round robin over `bases`."""
    urls = [f"{b}/v1/chat/completions" for b in bases]
    hdrs = headers or {}
    out = Level()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        warm = Level()
        await asyncio.gather(*(one(session, urls[i % len(urls)], stream, i, warm, hdrs)
                               for i in range(concurrency)))
        counter = iter(range(n))

        async def worker() -> None:
            for i in counter:
                await one(session, urls[i % len(urls)], stream, i, out, hdrs)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        out.wall_s = time.perf_counter() - t0
    return out


# -- the benchmark -----------------------------------------------------------------------------
@dataclass
class Report:
    lines: list[str] = field(default_factory=list)

    def add(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def measured(
    bases: list[str], stream: bool, conc: int, n: int, pid: int, headers: dict[str, str]
) -> tuple[Level, float]:
    """A saturating run through a proxy and the CPU seconds that process spent on it."""
    c0 = cpu_seconds(pid)
    level = asyncio.run(run_level(bases, stream, conc, n, headers))
    return level, cpu_seconds(pid) - c0


def saturation(procs: Procs, n: int, rep: Report) -> None:
    rep.add("## CPU per request: kvgate beside a bare pass-through, one run\n")
    rep.add("| mode | conc | bare CPU µs/req | kvgate CPU µs/req | kvgate / bare | req/s direct "
            "| req/s bare | req/s kvgate | kvgate core busy | errors direct/bare/kvgate |")
    rep.add("|---|---|---|---|---|---|---|---|---|---|")
    for stream in (False, True):
        for conc in (16, 128):
            direct = asyncio.run(run_level(procs.sims, stream, conc, n))
            bare, bare_cpu = measured([procs.bare], stream, conc, n, procs.bare_pid, {})
            via, cpu = measured([procs.gateway], stream, conc, n, procs.gateway_pid,
                                procs.headers)
            mode = f"streamed ({TOKENS} tokens)" if stream else "non-streamed"
            rep.add(f"| {mode} | {conc} | {bare_cpu / n * 1e6:.0f} | {cpu / n * 1e6:.0f} | "
                    f"{cpu / bare_cpu:.2f}x | {n / direct.wall_s:.0f} | {n / bare.wall_s:.0f} | "
                    f"{n / via.wall_s:.0f} | {cpu / via.wall_s * 100:.0f}% | "
                    f"{direct.errors}/{bare.errors}/{via.errors} |")
    rep.add("\nCPU is each process's utime+stime over the measured requests (warm-up excluded "
            "from the count but not from the CPU, a <2% overstatement). Both proxies run on the "
            "same core, one after the other; the bare pass-through (`loadtest/bare_proxy.py`: "
            "aiohttp server and client, round robin, no parsing, routing, accounting or "
            "metrics) is what any Python proxy on this stack pays at least.\n")


def granian(procs: Procs, n: int, rep: Report) -> None:
    """kvgate's app under granian beside uvicorn+httptools (what `kvgate serve` uses)."""
    port = _free_port()
    env = {**os.environ, "KVGATE_BENCH_UPSTREAMS": ",".join(procs.sims),
           "KVGATE_BENCH_MODEL": MODEL}
    proc = subprocess.Popen(
        [sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1",
         "--port", str(port), "--loop", "uvloop", "--workers", "1", "--log-level", "warning",
         "--no-ws", "loadtest.granian_app:app"],
        env=env, preexec_fn=_pinned({procs.core}))
    base = f"http://127.0.0.1:{port}"
    rep.add("\n## The ASGI server: uvicorn+httptools vs granian (same app, same core)\n")
    rep.add("| mode | conc | uvicorn CPU µs/req | granian CPU µs/req | granian / uvicorn |")
    rep.add("|---|---|---|---|---|")
    try:
        _wait(f"{base}/readyz")
        for stream in (False, True):
            for conc in (16, 128):
                _, uv = measured([procs.gateway], stream, conc, n, procs.gateway_pid, {})
                _, gr = measured([base], stream, conc, n, proc.pid, {})
                mode = "streamed" if stream else "non-streamed"
                rep.add(f"| {mode} | {conc} | {uv / n * 1e6:.0f} | {gr / n * 1e6:.0f} | "
                        f"{gr / uv:.2f}x |")
    finally:
        proc.terminate()
        proc.wait(15)


def set_latency(sims: list[str], ms: float, jitter_ms: float = 0.0) -> None:
    import urllib.request

    faults = {"latency_ms": ms, "latency_jitter_ms": jitter_ms}
    for sim in sims:
        req = urllib.request.Request(f"{sim}/sim/faults", data=orjson.dumps(faults),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=5).close()


def latency(
    base_direct: list[str], base_bare: str, base_gw: str, rounds: int, rep: Report,
    headers: dict[str, str],
) -> None:
    rep.add(f"## Added latency (ms) against direct: the bare pass-through and kvgate "
            f"(replicas answer after {UPSTREAM_MS}-{UPSTREAM_MS + JITTER_MS} ms)\n")
    rep.add("A replica that answers at once makes any concurrency a saturation test; real "
            f"replicas take long to answer, so here each waits {UPSTREAM_MS} ms plus 0-"
            f"{JITTER_MS} ms before its engine starts (the simulator's latency fault; the extra "
            "is a fixed fraction per prompt, so request i waits the same direct and via a "
            "proxy, and a closed-loop load does not arrive in lockstep waves of `conc` "
            "requests). The bare pass-through (`loadtest/bare_proxy.py`, same core) is what "
            "any extra hop costs on this machine: kvgate's own share is the difference.\n")
    rep.add("| mode | conc | p50 direct | added p50 bare / kvgate | p99 direct "
            "| added p99 bare / kvgate | TTFT p50 direct | added TTFT p50 bare / kvgate |")
    rep.add("|---|---|---|---|---|---|---|---|")
    set_latency(base_direct, UPSTREAM_MS, JITTER_MS)
    for stream in (False, True):
        for conc in (1, 32, 256):
            count = max(5 * rounds, conc * rounds)
            d = asyncio.run(run_level(base_direct, stream, conc, count))
            b = asyncio.run(run_level([base_bare], stream, conc, count))
            v = asyncio.run(run_level([base_gw], stream, conc, count, headers))
            cells = []
            for q in (0.5, 0.99):
                ref = pct(d.total_ms, q)
                cells.append(f"{ref:.2f} | {pct(b.total_ms, q) - ref:+.2f} / "
                             f"{pct(v.total_ms, q) - ref:+.2f}")
            ttft = "- | -"
            if stream:
                ref = pct(d.ttft_ms, 0.5)
                ttft = (f"{ref:.2f} | {pct(b.ttft_ms, 0.5) - ref:+.2f} / "
                        f"{pct(v.ttft_ms, 0.5) - ref:+.2f}")
            mode = "stream" if stream else "plain"
            rep.add(f"| {mode} | {conc} | {' | '.join(cells)} | {ttft} |")
    set_latency(base_direct, 0)


def memory(
    base_gw: list[str], pid: int, minutes: float, rep: Report, headers: dict[str, str]
) -> None:
    rep.add(f"\n## Memory over {minutes:g} minutes of load (concurrency 32, mixed)\n")
    rep.add("| minute | RSS MiB |")
    rep.add("|---|---|")
    samples = [rss_mib(pid)]
    rep.add(f"| 0 | {samples[0]:.1f} |")
    end = time.monotonic() + minutes * 60
    step = 0
    while time.monotonic() < end:
        asyncio.run(run_level(base_gw, step % 2 == 1, 32, 2000, headers))
        step += 1
        samples.append(rss_mib(pid))
        rep.add(f"| {(time.monotonic() - end) / 60 + minutes:.1f} | {samples[-1]:.1f} |")
    rep.add(f"\nRSS start {samples[0]:.1f} MiB, end {samples[-1]:.1f} MiB, max {max(samples):.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_overhead", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer requests (a minute or two)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--time-scale", type=float, default=1000.0)
    p.add_argument("--memory-minutes", type=float, default=0.0,
                   help="also run the memory test for this many minutes (e.g. 10)")
    p.add_argument("--auth", action="store_true",
                   help="kvgate authenticates every request (API key, in-memory tenancy store)")
    p.add_argument("--cpu-only", action="store_true", help="skip the added-latency runs")
    p.add_argument("--granian", action="store_true",
                   help="also run kvgate's app under granian (must be installed)")
    p.add_argument("--out", type=Path, default=None, help="default: loadtest/results/")
    args = p.parse_args(argv)
    out = args.out or RESULTS.with_name(
        RESULTS.stem + ("_auth" if args.auth else "") + RESULTS.suffix)
    n_sat, rounds = (1000, 6) if args.quick else (5000, 20)
    rep = Report()
    rep.add("# kvgate overhead benchmark\n")
    rep.add(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, kvgate pinned to one "
            f"core, {args.replicas} simulated replicas at time-scale {args.time_scale:g}, "
            f"{'quick' if args.quick else 'full'} run, {TOKENS}-token responses, chat "
            f"completions, aiohttp closed-loop load generator, "
            f"{'API-key auth (in-memory store)' if args.auth else '--no-auth'}. "
            f"Load average at the start: "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}.\n")
    with processes(args.replicas, args.time_scale, args.auth) as procs:
        # direct: the load generator spreads requests over the replicas itself
        saturation(procs, n_sat, rep)
        if args.granian:
            granian(procs, n_sat, rep)
        if not args.cpu_only:
            latency(procs.sims, procs.bare, procs.gateway, rounds, rep, procs.headers)
        if args.memory_minutes > 0:
            memory([procs.gateway], procs.gateway_pid, args.memory_minutes, rep, procs.headers)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    rep.add(f"\nLoad average at the end: {load} (on {os.cpu_count()} CPUs). Anything above "
            "~1.5 means other work shared the cores and the latency figures are noisy.")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(rep.lines) + "\n")
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
