"""Flow control benchmark: overload without collapse (issue 12), offline and live.

    python -m loadtest.bench_flow [--trace PATH] [--limit N] [--live] [--out loadtest/results]

Offline (simulated time, the gateway's flow-control code in front of the same router): the
Mooncake conversation trace on 8 simulated replicas (h100-8b-fp8, 262,144 KV tokens each),
30 % premium / 70 % free conversations (4 tenants per tier, equal weights), at 1.5x, 2x and 3x
its arrival rate (and 0.5x without flow control: the floor), flow control off and on; then the
same with tenant free-0 sending 5x its share (its extra requests added on top, so every other
tenant's traffic is identical); then a sweep, one threshold changed at a time. Per run: TTFT
p50/p99 and goodput at a 2 s TTFT SLO per tier, preemptions, sheds, the fair-share ratios and
their Jain index. Writes ``flow.md``, ``flow.json`` and ``flow.png``.

Live (``--live``): two real gateways on the same simulated replicas, flow control on and off,
measured alternately: added latency when nothing is saturated (p50 at concurrency 1 and 8,
with the count of requests that queued, which should be 0) and kvgate's CPU per request, plus the
in-process cost of the fast path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from loadtest.replay.cli import run_offline
from loadtest.replay.flow import FlowDriver, FlowSpec
from loadtest.replay.offline import FleetSpec
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.tiers import assign, noisy, parse_mix
from loadtest.replay.workload import ReplayRequest, load_mooncake
from routing.flow import FlowConfig, Saturation

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "shared/data/mooncake_conversation_trace.jsonl"
)
MIX = "premium:0.3,free:0.7"
TENANTS = 4
NOISY = "free-0"
RATES = (1.5, 2.0, 3.0)
FLOOR = 0.5  # the same workload at half the trace's rate, flow control off: TTFT's floor
# thresholds tried beside the defaults, one changed at a time (the figures behind the defaults)
SWEEP: dict[str, tuple[float, Saturation]] = {
    "prefill8k": (2.0, Saturation(max_prefill_tokens=8192)),
    "prefill32k": (2.0, Saturation(max_prefill_tokens=32768)),
    "unanswered4": (2.0, Saturation(max_unanswered=4)),
    "unanswered-off": (2.0, Saturation(max_unanswered=None)),
    "waiting0": (2.0, Saturation(max_waiting=0.0)),
    "knee0.8": (2.0, Saturation(kv_knee=0.8)),
    "3x-prefill8k": (3.0, Saturation(max_prefill_tokens=8192)),
    "3x-knee0.8": (3.0, Saturation(kv_knee=0.8)),
}
SLO_S = 2.0


# -- offline ------------------------------------------------------------------------------------
def workload(trace: Path, rate: float, limit: int | None, noisy_factor: float = 0.0
             ) -> list[ReplayRequest]:
    reqs = assign(load_mooncake(trace, rate_scale=rate, limit=limit), parse_mix(MIX), TENANTS)
    return noisy(reqs, NOISY, noisy_factor) if noisy_factor > 1 else reqs


def one_run(reqs: list[ReplayRequest], fleet: FleetSpec, on: bool,
            config: FlowConfig | None = None) -> dict[str, Any]:
    ref = pooled_reference_hit_rate(reqs, fleet.replicas * fleet.kv_tokens, fleet.block_size)
    t0 = time.perf_counter()
    spec = FlowSpec(config=config) if config is not None else FlowSpec()
    row = run_offline(reqs, fleet, "cache_aware", ref,
                      flow=FlowDriver(spec) if on else None, slo_ttft_s=SLO_S)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def offline(trace: Path, limit: int | None) -> dict[str, Any]:
    fleet = FleetSpec()
    runs: dict[str, Any] = {}
    runs[f"{FLOOR:g}x-off"] = one_run(workload(trace, FLOOR, limit), fleet, False)
    _progress(f"{FLOOR:g}x-off", runs[f"{FLOOR:g}x-off"])
    for rate in RATES:
        base = workload(trace, rate, limit)
        loud = workload(trace, rate, limit, 5.0) if rate >= 2.0 else None
        for on in (False, True):
            name = f"{rate:g}x-{'on' if on else 'off'}"
            runs[name] = one_run(base, fleet, on)
            _progress(name, runs[name])
            if loud is not None:
                runs[f"{name}-noisy"] = one_run(loud, fleet, on)
                _progress(f"{name}-noisy", runs[f"{name}-noisy"])
    for tag, (rate, rule) in SWEEP.items():
        name = tag if tag.startswith("3x") else f"{rate:g}x-on-{tag}"
        runs[name] = one_run(workload(trace, rate, limit), fleet, True,
                             FlowConfig(saturation=rule))
        _progress(name, runs[name])
    return runs


def _progress(name: str, row: dict[str, Any]) -> None:
    tiers = row["tiers"]
    print(f"{name:>16}: premium p99 {tiers['premium']['ttft_p99_s']} goodput "
          f"{tiers['premium']['goodput']} | free p99 {tiers['free']['ttft_p99_s']} goodput "
          f"{tiers['free']['goodput']} | preemptions {row['preemptions']} shed {row['shed']} "
          f"({row['wall_s']} s)", flush=True)


def _others_p99(row: dict[str, Any]) -> float:
    """TTFT p99 over every tenant but the noisy one, from the per-tenant p99s' worst."""
    return max(float(t["ttft_p99_s"]) for name, t in row["tenants"].items() if name != NOISY)


def _others(row: dict[str, Any], tier: str) -> float:
    return max(float(t["ttft_p99_s"]) for name, t in row["tenants"].items()
               if name != NOISY and name.startswith(tier))


def report(runs: dict[str, Any], live: dict[str, Any] | None) -> str:
    out = ["# Flow control: overload without collapse\n",
           "Offline: the Mooncake conversation trace (12,031 requests, one hour), 8 simulated "
           "replicas (h100-8b-fp8, 262,144 KV tokens each), cache_aware routing, 30 % premium /"
           " 70 % free conversations, 4 tenants per tier with equal weights; premium is band 0, "
           "free band 1 (minimum share 0.1); flow control with its defaults (`flow` config "
           f"section, `routing/flow/config.py`). Goodput: share of a tier's requests whose "
           f"first token came within {SLO_S:g} s (shed requests count as missed). Times are "
           "simulated seconds. `0.5x-off` is the same workload at half the trace's rate without "
           "flow control: nothing queues anywhere, so its TTFT is the floor the prompts' own "
           "prefill sets (the trace's longest prompts take seconds to prefill). "
           "`2x-on-<variant>` and `3x-<variant>` runs change one threshold from its default "
           "(the sweep behind the defaults). `-noisy`: tenant free-0 sends 5x its share on top.\n",
           "## Per tier\n",
           "| run | premium TTFT p50 | premium TTFT p99 | premium goodput | free TTFT p50 | "
           "free TTFT p99 | free goodput | all goodput | preemptions | shed | hit rate | "
           "queued | Jain |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in runs.items():
        t = row["tiers"]
        n = sum(x["requests"] for x in t.values())
        good = sum(x["goodput"] * x["requests"] for x in t.values()) / n
        flow = row.get("flow") or {}
        out.append(
            f"| {name} | {t['premium']['ttft_p50_s']} | {t['premium']['ttft_p99_s']} | "
            f"{t['premium']['goodput']} | {t['free']['ttft_p50_s']} | {t['free']['ttft_p99_s']}"
            f" | {t['free']['goodput']} | {good:.4f} | {row['preemptions']} | {row['shed']} | "
            f"{row['hit_rate']} | {flow.get('queued', '-')} | {flow.get('jain', '-')} |")
    out += ["", "## Targets\n", "| target | rate | off | on | ratio / verdict |",
            "|---|---|---|---|---|"]
    for rate in RATES:
        off, on = runs.get(f"{rate:g}x-off"), runs.get(f"{rate:g}x-on")
        if off is None or on is None:
            continue
        p_off, p_on = off["tiers"]["premium"]["ttft_p99_s"], on["tiers"]["premium"]["ttft_p99_s"]
        out.append(f"| premium TTFT p99 on <= 0.5x off | {rate:g}x | {p_off} | {p_on} | "
                   f"{p_on / p_off:.2f}x |")
        g = on["tiers"]["premium"]["goodput"]
        out.append(f"| premium goodput @ {SLO_S:g} s >= 95 % | {rate:g}x | "
                   f"{off['tiers']['premium']['goodput']} | {g} | "
                   f"{'met' if g >= 0.95 else 'missed'} |")
        fewer = on["preemptions"] <= off["preemptions"]
        out.append(f"| preemptions on <= off | {rate:g}x | {off['preemptions']} | "
                   f"{on['preemptions']} | {'met' if fewer else 'missed'} |")
        jain = (on.get("flow") or {}).get("jain")
        out.append(f"| equal-weight fair-share Jain >= 0.95 | {rate:g}x | - | {jain} | "
                   f"{'met' if jain is not None and jain >= 0.95 else 'missed'} |")
        for mode, row in (("off", off), ("on", on)):
            loud = runs.get(f"{rate:g}x-{mode}-noisy")
            if loud is None:
                continue
            for tier in ("premium", "free"):
                a, b = _others(row, tier), _others(loud, tier)
                out.append(f"| noisy {NOISY} (5x): other {tier} tenants' worst p99, flow "
                           f"{mode} | {rate:g}x | {a} | {b} (noisy) | {b / a - 1:+.1%} |")
    out += ["", "Fair-share ratios (flow on): per tenant, the tokens released to it while it "
            "competed with other backlogged tenants of its band, over what its weight entitled "
            "it to at those moments (1.0 = exactly its share).\n"]
    for name, row in runs.items():
        flow = row.get("flow")
        if flow:
            out.append(f"- {name}: " + ", ".join(f"{t} {r}" for t, r in flow["fair_share"].items())
                       + f" (Jain {flow['jain']})")
    if live:
        out += ["", "## Live (real gateways, simulated replicas)\n", live["text"]]
    return "\n".join(out) + "\n"


def plot(runs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_p99_s", "TTFT p99 (s)"),
                           (axes[1], "goodput", f"goodput @ {SLO_S:g} s TTFT")):
        for tier, color in (("premium", "tab:blue"), ("free", "tab:orange")):
            for mode, style in (("off", "--"), ("on", "-")):
                xs = [r for r in RATES if f"{r:g}x-{mode}" in runs]
                ys = [runs[f"{r:g}x-{mode}"]["tiers"][tier][key] for r in xs]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{tier}, flow {mode}")
        floor = runs.get(f"{FLOOR:g}x-off")
        if floor is not None:  # what the prompts' own prefill allows (nothing queues)
            ax.axhline(floor["tiers"]["premium"][key], color="gray", linestyle=":",
                       label=f"premium at {FLOOR:g}x (floor)")
        ax.set_xlabel("arrival rate (x the trace's)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Mooncake trace, 8 replicas, 30 % premium / 70 % free")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- live ---------------------------------------------------------------------------------------
def live_bench(quick: bool) -> dict[str, Any]:
    """Flow control on vs off on the same replicas: added latency unsaturated, CPU/request."""
    from loadtest import bench_overhead as bo

    cores = sorted(os.sched_getaffinity(0))
    gw_core = {cores[-1]}
    procs: list[subprocess.Popen[bytes]] = []
    lines: list[str] = []
    try:
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
        lines += ["Two gateways on the same 2 simulated replicas (time-scale 1000: they answer "
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
        n_cpu = 1500 if quick else 4000
        lines += ["", "CPU per request: concurrency 8 (not saturated), kvgate pinned to one "
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_flow", description=__doc__)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    p.add_argument("--live", action="store_true", help="also the live on/off comparison")
    p.add_argument("--quick", action="store_true", help="a shorter live run")
    p.add_argument("--live-only", action="store_true",
                   help="only the live part (the offline runs from the saved flow.json)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "flow.json"
    before = orjson.loads(saved.read_bytes()) if saved.exists() else {}
    runs = offline(args.trace, args.limit) if not args.live_only else before["offline"]
    write(args.out, runs, before.get("live"))  # the offline figures kept if the live part fails
    if args.live or args.live_only:
        write(args.out, runs, live_bench(args.quick))
    return 0


def write(out: Path, runs: dict[str, Any], live: dict[str, Any] | None) -> None:
    (out / "flow.json").write_bytes(orjson.dumps(
        {"offline": runs, "live": live}, option=orjson.OPT_INDENT_2))
    (out / "flow.md").write_text(report(runs, live))
    plot(runs, out / "flow.png")
    print(f"written to {out}/flow.md, flow.json, flow.png", flush=True)


if __name__ == "__main__":
    sys.exit(main())
