"""The flow control benchmark's report (`loadtest.bench_flow`): ``flow.md`` from the offline
runs (per tier, the targets, premium's floor, the fair-share ratios) and the live part, and
``flow.png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtest.flow_runs import FLOOR, NOISY, NOISY_FACTORS, RATES, SEEDS, SLO_S

__all__ = ["plot", "report"]


def _others(row: dict[str, Any], tier: str) -> float:
    """The worst TTFT p99 among the tier's tenants other than the noisy one."""
    return max(float(t["ttft_p99_s"]) for name, t in row["tenants"].items()
               if name != NOISY and name.startswith(tier))


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
    out = [*_intro(), *_per_tier(runs), *_targets(runs), *_floor(runs, floor),
           *_fair_shares(runs)]
    if live:
        out += ["", "## Live (real gateways, simulated replicas)\n", live["text"]]
    return "\n".join(out) + "\n"


def _intro() -> list[str]:
    return ["# Flow control: overload without collapse\n",
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
            "default (the sweeps behind the defaults).\n"]


def _per_tier(runs: dict[str, Any]) -> list[str]:
    out = ["## Per tier\n",
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
    return out


def _targets(runs: dict[str, Any]) -> list[str]:
    out = ["", "## Targets\n",
           "| target | rate | off | on | on, no share cap | verdict (on) |",
           "|---|---|---|---|---|---|"]
    for rate in RATES:
        out += _rate_targets(runs, rate)
    return out + _noisy_variants(runs)


def _p99_vs(row: dict[str, Any], p_off: float) -> str:
    """Premium's TTFT p99 in a run and its ratio to the run without flow control."""
    if not row:
        return "-"
    p = row["tiers"]["premium"]["ttft_p99_s"]
    return f"{p} ({p / p_off:.2f}x)"


def _premium(row: dict[str, Any], key: str) -> str:
    return str(row["tiers"]["premium"][key]) if row else "-"


def _rate_targets(runs: dict[str, Any], rate: float) -> list[str]:
    """The targets' rows at one rate: premium's p99 and goodput, preemptions, the Jain index,
    and with the noisy tenant's runs what it does to the others."""
    off, on = runs.get(f"{rate:g}x-off"), runs.get(f"{rate:g}x-on")
    if off is None or on is None:
        return []
    nocap = runs.get(f"{rate:g}x-nocap") or {}
    p_off = off["tiers"]["premium"]["ttft_p99_s"]
    p_on, g_on = on["tiers"]["premium"]["ttft_p99_s"], on["tiers"]["premium"]["goodput"]
    out = [
        f"| premium TTFT p99 on <= 0.5x off | {rate:g}x | {p_off} | {_p99_vs(on, p_off)} | "
        f"{_p99_vs(nocap, p_off)} | {'met' if p_on <= 0.5 * p_off else 'missed'} |",
        f"| premium goodput @ {SLO_S:g} s >= 95 % | {rate:g}x | "
        f"{_premium(off, 'goodput')} | {g_on} | {_premium(nocap, 'goodput')} | "
        f"{'met' if g_on >= 0.95 else 'missed'} |",
        f"| preemptions on <= off | {rate:g}x | {off['preemptions']} | {on['preemptions']} "
        f"| {nocap.get('preemptions', '-')} | "
        f"{'met' if on['preemptions'] <= off['preemptions'] else 'missed'} |",
        f"| equal-weight fair-share Jain >= 0.95 | {rate:g}x | - | {_jain(on)} | "
        f"{_jain(nocap) if nocap else '-'} | {_verdict(on)} |"]
    loud = {m: runs.get(f"{rate:g}x-{m}-noisy") or {} for m in ("off", "on", "nocap")}
    if all(loud.values()):
        out += _noisy_rows(rate, {"off": off, "on": on, "nocap": nocap}, loud)
    return out


def _noisy_rows(rate: float, quiet: dict[str, Any], loud: dict[str, Any]) -> list[str]:
    """The noisy tenant (5x) against the same rate without it: the Jain index, and the other
    tenants' worst p99 per tier, off / on / without the share cap."""
    out = [f"| equal-weight fair-share Jain >= 0.95, noisy | {rate:g}x | - | "
           f"{_jain(loud['on'])} | {_jain(loud['nocap'])} | {_verdict(loud['on'])} |"]
    for tier in ("premium", "free"):
        cells = []
        for m in ("off", "on", "nocap"):
            a, b = _others(quiet[m], tier), _others(loud[m], tier)
            cells.append(f"{a} → {b} ({b / a - 1:+.0%})")
        a, b = _others(quiet["on"], tier), _others(loud["on"], tier)
        out.append(f"| noisy {NOISY} (5x) raises the other {tier} tenants' worst p99 by "
                   f"<= 10 % | {rate:g}x | {' | '.join(cells)} | "
                   f"{'met' if b <= 1.1 * a else 'missed'} |")
    return out


def _noisy_variants(runs: dict[str, Any]) -> list[str]:
    """The noisy tenant at other factors and on other seeds (flow control on, 2x)."""
    out: list[str] = []
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
    return out


def _floor(runs: dict[str, Any], floor: dict[str, float] | None) -> list[str]:
    """Premium's TTFT p99 when nothing of anyone else's is in its way."""
    base, alone, low = runs.get("2x-off"), runs.get("2x-premium-alone-off"), runs.get(
        f"{FLOOR:g}x-off")
    if not (base and alone and low):
        return []
    target = 0.5 * base["tiers"]["premium"]["ttft_p99_s"]
    out = ["", "## Premium's TTFT p99: the floor\n",
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
    return out


def _fair_shares(runs: dict[str, Any]) -> list[str]:
    out = ["", "Fair-share ratios (flow on; `loadtest/replay/fairshare.py`): per tenant, "
           "the tokens released to it from the queue over its weighted max-min share of what "
           "its band released, window by window (10 s) while it had requests queued; a tenant "
           "that asked for less than its share is owed what it asked for (1.0 = exactly its "
           "share).\n"]
    for name, row in runs.items():
        flow = row.get("flow")
        if flow:
            out.append(f"- {name}: " + ", ".join(f"{t} {r}" for t, r in flow["fair_share"].items())
                       + f" (Jain {flow['jain']})")
    return out


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
