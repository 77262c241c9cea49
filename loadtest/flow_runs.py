"""The flow control benchmark's offline runs (`loadtest.bench_flow`): the workload (the
Mooncake conversation trace with tiers, tenants and a noisy tenant drawn), every run by name
(`plan`), each replayed in simulated time with the gateway's flow-control code in front of the
router, and premium's floors.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.replay.cli import run_offline
from loadtest.replay.flow import FlowDriver, FlowSpec
from loadtest.replay.offline import FleetSpec
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.tiers import assign, noisy, parse_mix
from loadtest.replay.workload import ReplayRequest, load_mooncake
from loadtest.sim.engine import Engine
from loadtest.sim.spec import RequestSpec
from routing.flow import FlowConfig, Saturation

__all__ = ["FLOOR", "NOISY", "NOISY_FACTORS", "RATES", "SEEDS", "SLO_S", "Run", "offline", "plan",
           "premium_floor"]

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
