"""Flow control benchmark: overload without collapse (issue 12), offline and live.

    python -m loadtest.bench_flow [--trace PATH] [--limit N] [--jobs N] [--live]
                                  [--out loadtest/results]

Offline (simulated time, the gateway's flow-control code in front of the same router): the
Mooncake conversation trace on 8 simulated replicas (h100-8b-fp8, 262,144 KV tokens each),
30 % premium / 70 % free conversations (4 tenants per tier, equal weights), at 1.5x, 2x and 3x
its arrival rate, flow control off, on, and on without the share cap; then the same with
tenant free-0 sending 5x its share (its extra requests added on top, so every other tenant's
traffic is identical); premium's floors (0.5x without flow control, premium alone at 2x, its
99th-percentile prompt alone on an idle replica); then the share cap's sweep and (``--sweep``)
the saturation thresholds', one setting changed at a time.
Per run: TTFT p50/p99 and goodput at a 2 s TTFT SLO per tier and tenant, preemptions, sheds,
the fair-share ratios (`loadtest.replay.fairshare`) and their Jain index. Writes ``flow.md``,
``flow.json`` and ``flow.png``.

Live (``--live``): two real gateways on the same simulated replicas, flow control on and off,
measured alternately: added latency when nothing is saturated (p50 at concurrency 1 and 8,
with the count of requests that queued, which should be 0) and kvgate's CPU per request, plus the
in-process cost of the fast path.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtest.replay.cli import run_offline
from loadtest.replay.flow import FlowDriver, FlowSpec
from loadtest.replay.offline import FleetSpec
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.tiers import assign, noisy, parse_mix
from loadtest.replay.workload import ReplayRequest, load_mooncake
from loadtest.sim.engine import Engine
from loadtest.sim.spec import RequestSpec
from routing.flow import FlowConfig, Saturation

RESULTS = Path(__file__).resolve().parent / "results"
# the 2-minute sample shipped in the repo; the whole hour (loadtest/data/README.md) with --trace
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_sample.jsonl"
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
# the share cap's settings tried beside the defaults (share_cap 2, share_headroom 0.5), on
# 2x with the noisy tenant
# the noisy tenant at other factors (flow control on, 2x): the rule on other shapes of abuse
NOISY_FACTORS = (3.0, 10.0)
# ... and on other draws of the tiers and tenants (`tiers.assign`'s and `tiers.noisy`'s seed;
# the table's runs are seed 0): each tenant another set of conversations
SEEDS = (1, 2)
SHARE_SWEEP: dict[str, FlowConfig] = {
    "headroom0": FlowConfig(share_headroom=0.0),
    "headroom0.25": FlowConfig(share_headroom=0.25),
    "headroom0.75": FlowConfig(share_headroom=0.75),
}


# -- offline ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Run:
    """One offline run: the workload (rate, the noisy tenant's factor, premium alone) and the
    flow control in front of it (None: off)."""

    rate: float
    config: FlowConfig | None
    noisy: float = 0.0
    premium_alone: bool = False
    seed: int = 0  # the draw of tiers, tenants and the noisy tenant's extra requests


def workload(trace: Path, rate: float, limit: int | None, noisy_factor: float = 0.0,
             seed: int = 0) -> list[ReplayRequest]:
    reqs = assign(load_mooncake(trace, rate_scale=rate, limit=limit), parse_mix(MIX), TENANTS,
                  seed)
    return noisy(reqs, NOISY, noisy_factor, seed) if noisy_factor > 1 else reqs


def one_run(reqs: list[ReplayRequest], fleet: FleetSpec, config: FlowConfig | None
            ) -> dict[str, Any]:
    ref = pooled_reference_hit_rate(reqs, fleet.replicas * fleet.kv_tokens, fleet.block_size)
    t0 = time.perf_counter()
    flow = FlowDriver(FlowSpec(config=config)) if config is not None else None
    row = run_offline(reqs, fleet, "cache_aware", ref, flow=flow, slo_ttft_s=SLO_S)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def plan(sweep: bool = False) -> dict[str, Run]:
    """Every offline run by name: the floors, each rate off / on / on without the share cap
    (and with the noisy tenant at 2x; 3x off and on only), the share cap's sweep, and with
    ``sweep`` the saturation thresholds' (one setting changed at a time)."""
    on, nocap = FlowConfig(), FlowConfig(share_cap=None)
    runs = {f"{FLOOR:g}x-off": Run(FLOOR, None),
            "2x-premium-alone-off": Run(2.0, None, premium_alone=True)}
    for rate in RATES:
        for loud in ((0.0, 5.0) if rate == 2.0 else (0.0,)):
            tail = "-noisy" if loud else ""
            for mode, config in (("off", None), ("on", on), ("nocap", nocap)):
                if not (mode == "nocap" and rate > 2.0):
                    runs[f"{rate:g}x-{mode}{tail}"] = Run(rate, config, loud)
    for factor in NOISY_FACTORS:
        runs[f"2x-on-noisy{factor:g}x"] = Run(2.0, on, factor)
    for seed in SEEDS:
        runs[f"2x-on-seed{seed}"] = Run(2.0, on, seed=seed)
        runs[f"2x-on-noisy-seed{seed}"] = Run(2.0, on, 5.0, seed=seed)
    for tag, config in SHARE_SWEEP.items():
        runs[f"2x-on-noisy-{tag}"] = Run(2.0, config, 5.0)
    for tag, (rate, rule) in SWEEP.items() if sweep else ():
        name = tag if tag.startswith("3x") else f"{rate:g}x-on-{tag}"
        runs[name] = Run(rate, FlowConfig(saturation=rule))
    return runs


def _run_one(args: tuple[str, Run, Path, int | None]) -> tuple[str, dict[str, Any]]:
    name, run, trace, limit = args
    reqs = workload(trace, run.rate, limit, run.noisy, run.seed)
    if run.premium_alone:
        reqs = [r for r in reqs if r.tier == "premium"]
    row = one_run(reqs, FleetSpec(), run.config)
    _progress(name, row)
    return name, row


def offline(trace: Path, limit: int | None, jobs: int = 1, sweep: bool = False,
            only: set[str] | None = None) -> dict[str, Any]:
    """Every run of `plan`, or the ``only`` ones (``jobs`` at a time, the longest first: each
    is deterministic in simulated time)."""
    runs = {n: r for n, r in plan(sweep).items() if only is None or n in only}
    order = sorted(runs.items(), key=lambda nr: (-nr[1].noisy, -nr[1].rate))
    todo = [(name, run, trace, limit) for name, run in order]
    if jobs <= 1:
        done = dict(map(_run_one, todo))
    else:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            done = dict(pool.imap_unordered(_run_one, todo))
    return {name: done[name] for name in runs}


def _progress(name: str, row: dict[str, Any]) -> None:
    tiers = " | ".join(f"{t} p99 {x['ttft_p99_s']} goodput {x['goodput']}"
                       for t, x in row["tiers"].items())
    print(f"{name:>24}: {tiers} | preemptions {row['preemptions']} shed {row['shed']} "
          f"({row['wall_s']} s)", flush=True)


def _others(row: dict[str, Any], tier: str) -> float:
    """The worst TTFT p99 among the tier's tenants other than the noisy one."""
    return max(float(t["ttft_p99_s"]) for name, t in row["tenants"].items()
               if name != NOISY and name.startswith(tier))


def idle_ttft(prompt_tokens: int) -> float:
    """Seconds to the first token of a prompt alone on an idle replica, nothing cached (the
    simulator's cost model): what no scheduling can shorten."""
    engine = Engine(FleetSpec().engine_config())
    blocks = tuple(range(prompt_tokens // 16))
    engine.add_request(RequestSpec("idle", blocks, prompt_tokens, 1), 0.0)
    first = [o.first_token_time for o in engine.advance(math.inf) if o.first_token_time]
    return float(first[0])


def premium_floor(trace: Path, limit: int | None) -> dict[str, float]:
    """Premium's prompts at their 99th percentile length, and its prefill alone and idle."""
    reqs = [r for r in workload(trace, 1.0, limit) if r.tier == "premium"]
    lengths = sorted(r.prompt_tokens for r in reqs)
    p99 = lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))]
    return {"requests": len(reqs), "prompt_p99_tokens": p99,
            "idle_ttft_p99_prompt_s": round(idle_ttft(p99), 3)}


def _jain(row: dict[str, Any]) -> str:
    """The Jain index and how many 10 s windows it judged."""
    flow = row.get("flow") or {}
    return f"{flow.get('jain')} ({flow.get('fair_windows', 0)} windows)"


def _verdict(row: dict[str, Any]) -> str:
    jain = (row.get("flow") or {}).get("jain")
    return "n/a: nobody shared" if jain is None else "met" if jain >= 0.95 else "missed"


def _tier(row: dict[str, Any], tier: str, key: str) -> str:
    t = row["tiers"].get(tier)
    return str(t[key]) if t is not None else "-"


def report(runs: dict[str, Any], live: dict[str, Any] | None,
           floor: dict[str, float] | None = None) -> str:
    out = ["# Flow control: overload without collapse\n",
           "Offline: the Mooncake conversation trace (12,031 requests, one hour), 8 simulated "
           "replicas (h100-8b-fp8, 262,144 KV tokens each), cache_aware routing, 30 % premium /"
           " 70 % free conversations, 4 tenants per tier with equal weights; premium is band 0, "
           "free band 1 (minimum share 0.1); flow control with its defaults (`flow` config "
           "section, `routing/flow/config.py`), the share cap included (`share_cap` 2, "
           f"`share_headroom` 0.5). Goodput: share of a tier's requests whose "
           f"first token came within {SLO_S:g} s (shed requests count as missed). Times are "
           "simulated seconds. Per rate: `off` without flow control, `on` with it, `nocap` "
           "with it but without the share cap (`share_cap: null`, the flow control of the first "
           "version). `-noisy`: tenant free-0 sends 5x its share on top (`-noisy3x`, "
           "`-noisy10x`: 3x, 10x); `-seed1`, `-seed2`: the tiers, tenants and the noisy tenant's "
           "extra requests drawn with another seed (the others: seed 0). `0.5x-off` is the "
           "same workload at half the trace's rate without flow control (nothing queues "
           "anywhere) and `2x-premium-alone-off` premium's own requests at 2x with nothing "
           "else on the replicas: the floors of premium's TTFT. `2x-on-<variant>`, "
           "`2x-on-noisy-<variant>` and `3x-<variant>` runs change one setting from its "
           "default (the sweeps behind the defaults).\n",
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
        cells = [_tier(row, tier, key) for tier in ("premium", "free")
                 for key in ("ttft_p50_s", "ttft_p99_s", "goodput")]
        out.append(f"| {name} | {' | '.join(cells)} | {good:.4f} | {row['preemptions']} | "
                   f"{row['shed']} | {row['hit_rate']} | {flow.get('queued', '-')} | "
                   f"{flow.get('jain', '-')} |")
    out += ["", "## Targets\n",
            "| target | rate | off | on | on, no share cap | verdict (on) |",
            "|---|---|---|---|---|---|"]
    for rate in RATES:
        off, on = runs.get(f"{rate:g}x-off"), runs.get(f"{rate:g}x-on")
        if off is None or on is None:
            continue
        nocap = runs.get(f"{rate:g}x-nocap") or {}
        p_off = off["tiers"]["premium"]["ttft_p99_s"]

        def p99(row: dict[str, Any], p_off: float = p_off) -> str:
            if not row:
                return "-"
            p = row["tiers"]["premium"]["ttft_p99_s"]
            return f"{p} ({p / p_off:.2f}x)"

        def premium(row: dict[str, Any], key: str) -> str:
            return str(row["tiers"]["premium"][key]) if row else "-"

        p_on, g_on = on["tiers"]["premium"]["ttft_p99_s"], on["tiers"]["premium"]["goodput"]
        out += [
            f"| premium TTFT p99 on <= 0.5x off | {rate:g}x | {p_off} | {p99(on)} | "
            f"{p99(nocap)} | {'met' if p_on <= 0.5 * p_off else 'missed'} |",
            f"| premium goodput @ {SLO_S:g} s >= 95 % | {rate:g}x | "
            f"{premium(off, 'goodput')} | {g_on} | {premium(nocap, 'goodput')} | "
            f"{'met' if g_on >= 0.95 else 'missed'} |",
            f"| preemptions on <= off | {rate:g}x | {off['preemptions']} | {on['preemptions']} "
            f"| {nocap.get('preemptions', '-')} | "
            f"{'met' if on['preemptions'] <= off['preemptions'] else 'missed'} |",
            f"| equal-weight fair-share Jain >= 0.95 | {rate:g}x | - | {_jain(on)} | "
            f"{_jain(nocap) if nocap else '-'} | {_verdict(on)} |"]
        loud = {m: runs.get(f"{rate:g}x-{m}-noisy") or {} for m in ("off", "on", "nocap")}
        if not all(loud.values()):
            continue
        out.append(f"| equal-weight fair-share Jain >= 0.95, noisy | {rate:g}x | - | "
                   f"{_jain(loud['on'])} | {_jain(loud['nocap'])} | {_verdict(loud['on'])} |")
        quiet = {"off": off, "on": on, "nocap": nocap}
        for tier in ("premium", "free"):
            cells = []
            for m in ("off", "on", "nocap"):
                a, b = _others(quiet[m], tier), _others(loud[m], tier)
                cells.append(f"{a} → {b} ({b / a - 1:+.0%})")
            a, b = _others(on, tier), _others(loud["on"], tier)
            out.append(f"| noisy {NOISY} (5x) raises the other {tier} tenants' worst p99 by "
                       f"<= 10 % | {rate:g}x | {' | '.join(cells)} | "
                       f"{'met' if b <= 1.1 * a else 'missed'} |")
    pairs = [(f"{f:g}x", "2x-on", f"2x-on-noisy{f:g}x") for f in NOISY_FACTORS]
    pairs += [(f"5x, seed {s}", f"2x-on-seed{s}", f"2x-on-noisy-seed{s}") for s in SEEDS]
    for label, quiet_name, loud_name in pairs:
        q, loud_on = runs.get(quiet_name), runs.get(loud_name)
        if q is None or loud_on is None:
            continue
        for tier in ("premium", "free"):
            a, b = _others(q, tier), _others(loud_on, tier)
            out.append(f"| noisy {NOISY} ({label}) raises the other {tier} tenants' worst "
                       f"p99 by <= 10 % | 2x | - | {a} → {b} ({b / a - 1:+.0%}) | - | "
                       f"{'met' if b <= 1.1 * a else 'missed'} |")
    base, alone, low = runs.get("2x-off"), runs.get("2x-premium-alone-off"), runs.get(
        f"{FLOOR:g}x-off")
    if base and alone and low:
        target = 0.5 * base["tiers"]["premium"]["ttft_p99_s"]
        out += ["", "## Premium's TTFT p99: the floor\n",
                f"The target at 2x is half the uncontrolled p99: {target:.2f} s. What premium "
                "gets when nothing of anyone else's is in its way:\n",
                "| premium TTFT p99 | s |", "|---|---|",
                f"| 2x without flow control (the reference) | "
                f"{base['tiers']['premium']['ttft_p99_s']} |",
                f"| {FLOOR:g}x, every tier, without flow control (nothing queues) | "
                f"{low['tiers']['premium']['ttft_p99_s']} |",
                f"| 2x, premium's own requests alone on the 8 replicas | "
                f"{alone['tiers']['premium']['ttft_p99_s']} |"]
        if floor:
            out.append(f"| one prompt of premium's 99th percentile length "
                       f"({floor['prompt_p99_tokens']:,} tokens), alone on an idle replica, "
                       f"nothing cached | {floor['idle_ttft_p99_prompt_s']} |")
    out += ["", "Fair-share ratios (flow on; `loadtest/replay/fairshare.py`): per tenant, "
            "the tokens released to it from the queue over its weighted max-min share of what "
            "its band released, window by window (10 s) while it had requests queued; a tenant "
            "that asked for less than its share is owed what it asked for (1.0 = exactly its "
            "share).\n"]
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
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="a Mooncake-format trace (default: the 2-minute sample, "
                        "loadtest/data/mooncake_sample.jsonl; the whole hour, which the saved "
                        "results use: see loadtest/data/README.md)")
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    p.add_argument("--jobs", type=int, default=1,
                   help="offline runs at a time (each is deterministic; default 1)")
    p.add_argument("--sweep", action="store_true",
                   help="also the saturation thresholds' sweep (8 runs more)")
    p.add_argument("--only", metavar="RUN,...",
                   help="re-run only these offline runs (names as in flow.md); the others are "
                        "kept from the saved flow.json")
    p.add_argument("--live", action="store_true", help="also the live on/off comparison")
    p.add_argument("--quick", action="store_true", help="a shorter live run")
    p.add_argument("--live-only", action="store_true",
                   help="only the live part (the offline runs from the saved flow.json)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "flow.json"
    before = orjson.loads(saved.read_bytes()) if saved.exists() else {}
    if args.live_only:
        runs, floor = before["offline"], before.get("floor")
    else:
        only = set(args.only.split(",")) if args.only else None
        fresh = offline(args.trace, args.limit, args.jobs, args.sweep, only)
        kept = before.get("offline", {}) if only else {}
        runs = {n: fresh.get(n) or kept[n] for n in plan(args.sweep) if n in fresh or n in kept}
        floor = premium_floor(args.trace, args.limit) if not only else before.get("floor")
    write(args.out, runs, floor, before.get("live"))  # kept if the live part fails
    if args.live or args.live_only:
        write(args.out, runs, floor, live_bench(args.quick))
    return 0


def write(out: Path, runs: dict[str, Any], floor: dict[str, float] | None,
          live: dict[str, Any] | None) -> None:
    (out / "flow.json").write_bytes(orjson.dumps(
        {"offline": runs, "floor": floor, "live": live}, option=orjson.OPT_INDENT_2))
    (out / "flow.md").write_text(report(runs, live, floor))
    plot(runs, out / "flow.png")
    print(f"written to {out}/flow.md, flow.json, flow.png", flush=True)


if __name__ == "__main__":
    sys.exit(main())
