"""`kvgate replay`: replay a workload against routing policies, offline or live.

    kvgate replay TRACE.jsonl --offline --replicas 8 --kv-tokens 262144 --policy all --json OUT
    kvgate replay TRACE.jsonl --target http://127.0.0.1:8000 --replica URL ... --time-scale 20
    kvgate replay --synthetic --spawn --replicas 4 --policy all --time-scale 20 --json OUT
    kvgate replay --workload agent-loops --offline --kv-tokens 1048576 --policy all

Offline runs the routing core and the simulator's engines in one process in simulated time.
Live sends the requests over HTTP to a running kvgate (`--target`) or to a fleet it starts
itself (`--spawn`: N `kvgate sim` replicas and one `kvgate serve` per policy). Offline,
`--policy all` also runs the yardsticks: re-implementations of peer routers' published rules
and the oracle (which reads the engines' true state); every summary is then compared with
the oracle's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import orjson

from loadtest.cmdline import positive
from loadtest.fleet import Fleet
from loadtest.replay import tiers
from loadtest.replay.flow import FlowDriver, flow_report, flow_spec
from loadtest.replay.generators import WORKLOADS
from loadtest.replay.live import LiveTarget, replay_live
from loadtest.replay.offline import FleetSpec, GatewaySpec, replay_offline
from loadtest.replay.reference import pooled_reference_hit_rate
from loadtest.replay.report import (
    Progress,
    ReplayError,
    default_json_path,
    format_table,
    report_failures,
)
from loadtest.replay.summary import against_oracle, summarize
from loadtest.replay.trace import TraceError, collector_paused
from loadtest.replay.unseen import UNSEEN
from loadtest.replay.workload import ReplayRequest, load_mooncake, synthetic_multitenant
from loadtest.sim.costmodel import PRESETS
from routing.policies import REGISTRY, YARDSTICKS
from routing.router import RouterConfig

__all__ = ["main", "run_offline"]

SPAWN_MODEL = "replay-model"
OFFLINE_ONLY = (*YARDSTICKS, "oracle")  # yardsticks: never served, replayed offline
YEAR_S = 365.25 * 86_400.0
# arrivals beyond this are a unit mistake (microseconds read as milliseconds), not a workload
MAX_SPAN_S = 10 * YEAR_S


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate replay", description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", help="a Mooncake-format JSONL trace")
    p.add_argument("--synthetic", action="store_true", help="the synthetic multi-tenant workload")
    p.add_argument("--workload", choices=sorted({**WORKLOADS, **UNSEEN}),
                   help="a generated workload (loadtest.replay.generators, unseen)")
    p.add_argument("--offline", action="store_true", help="simulated time, no HTTP")
    p.add_argument("--replicas", type=positive(int), default=8,
                   help="replicas simulated offline or started by --spawn (default 8)")
    p.add_argument("--kv-tokens", type=positive(int), default=262_144,
                   help="KV cache per replica, offline or --spawn (default 262144)")
    p.add_argument("--policy", default="cache_aware",
                   help=f"{', '.join(REGISTRY)}; offline also {', '.join(OFFLINE_ONLY)}; or all "
                        "(default cache_aware)")
    p.add_argument("--rate-scale", type=positive(float), default=1.0,
                   help="arrivals X times faster (default 1)")
    p.add_argument("--profile", default=PRESETS[0].name, choices=[x.name for x in PRESETS],
                   help=f"the simulated engine's cost model, offline or --spawn "
                        f"(default {PRESETS[0].name})")
    p.add_argument("--limit", type=positive(int), help="replay only the first N requests")
    p.add_argument("--json", metavar="OUT", nargs="?", const="",
                   help="write the summaries as JSON to OUT (a file, or a directory for a "
                        "timestamped file in it; bare --json: one in the working directory)")
    gw = p.add_argument_group("several gateways (offline)")
    gw.add_argument("--gateways", type=positive(int), default=1,
                    help="spread requests at random over N routers, each with its own counts")
    gw.add_argument("--sync-delay-ms", type=positive(float, zero=True), default=10.0,
                    help="a router sees the others' records this much later (default 10)")
    gw.add_argument("--no-share", action="store_true",
                    help="the N routers share nothing (the baseline)")
    gw.add_argument("--no-defer", action="store_true",
                    help="pick at arrival: no pick held until the lower-ranked routers' "
                         "records of the same instant arrive (docs/shared-state.md)")
    gw.add_argument("--gateway-seed", type=int, default=0,
                    help="which router takes which request (a single run moves by a few per "
                         "cent between seeds: compare means over several)")
    live = p.add_argument_group("live mode")
    live.add_argument("--target", help="a running kvgate's address, e.g. "
                                       "http://127.0.0.1:8000, without /v1")
    live.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a replica behind --target, for its /metrics counters (repeat)",
    )
    live.add_argument("--model", help="public model name (default: the first listed)")
    live.add_argument("--spawn", action="store_true", help="start the simulators and gateways")
    live.add_argument(
        "--time-scale",
        type=positive(float),
        default=1.0,
        help="the simulators' --time-scale (workload times are divided by it)",
    )
    live.add_argument("--api-key", help="bearer key for --target")
    tiers.add_args(p)
    return p


class UsageError(ReplayError):
    """What was given cannot be replayed (a flag's value, the trace, where --json goes): said
    before anything runs, exit status 2 (1: the replay ran and requests failed, or a target
    failed)."""


def _check_args(args: argparse.Namespace) -> list[str]:
    """The policies to run, once every flag is known to be usable: an unknown policy was told
    after the whole trace was read, and an unwritable --json after the whole replay ran."""
    sources = [bool(args.trace), args.synthetic, bool(args.workload)]
    if sum(sources) != 1:  # a TRACE given with --synthetic was silently not replayed
        raise UsageError("give one workload: a TRACE file, --synthetic or --workload NAME")
    if not (args.offline or args.spawn or args.target):
        raise UsageError("live mode needs --target URL or --spawn (or --offline)")
    if args.gateways > 1 and not args.offline:  # a live run sent through one gateway, unsaid
        raise UsageError("--gateways: offline only (a live replay goes through --target's "
                         "gateway, or one --spawn starts)")
    block = FleetSpec().block_size
    if args.kv_tokens < 2 * block:  # the engine's KV cache reserves one block
        raise UsageError(f"--kv-tokens: at least {2 * block} (two KV blocks of {block} tokens)")
    if args.json is not None:
        args.json = _json_target(args.json)
    policies = _policies(args.policy, args.offline)
    if args.target and not (args.offline or args.spawn):
        # a running gateway routes with its own policy: one run, its row named `target`
        return policies[:1]
    return policies


def _json_target(given: str) -> Path:
    """Where --json writes, tried now by opening it (and removing it again if it is new)."""
    path = Path(given or ".")
    if path.is_dir():
        path = default_json_path(path)
    try:
        existed = path.exists()
        with open(path, "ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise UsageError(f"--json {path}: {exc.strerror or exc}") from None
    return path


def _workload(args: argparse.Namespace) -> list[ReplayRequest]:
    notes: list[str] = []
    if args.synthetic or args.workload:
        make = {**WORKLOADS, **UNSEEN}.get(args.workload or "", synthetic_multitenant)
        reqs = make()
        if args.rate_scale != 1.0:
            reqs = [replace(r, arrival_s=r.arrival_s / args.rate_scale) for r in reqs]
        reqs = reqs[: args.limit] if args.limit else reqs
    else:
        reqs = _trace(args, notes)
    span = max(r.arrival_s for r in reqs)
    if not span <= MAX_SPAN_S:  # (and not nan) a live replay would wait for years
        whose = f"the trace {args.trace}: " if args.trace else ""
        raise UsageError(
            f"{whose}the arrivals span {span / YEAR_S:.3g} years at --rate-scale "
            f"{args.rate_scale:g}: a trace's timestamps are milliseconds (--rate-scale 1000 "
            f"reads microseconds, 1000000 nanoseconds)")
    for note in notes:  # after the refusals: no warning before a refusal that says more
        print(f"kvgate replay: warning: {note}", file=sys.stderr)
    return reqs


def _trace(args: argparse.Namespace, notes: list[str]) -> list[ReplayRequest]:
    try:
        with collector_paused():
            return load_mooncake(args.trace, rate_scale=args.rate_scale, limit=args.limit,
                                 notes=notes)
    except OSError as exc:
        raise UsageError(f"cannot read the trace {args.trace}: {exc.strerror or exc}") from None
    except TraceError as exc:
        raise UsageError(f"the trace {args.trace}: {exc}") from None


def _policies(name: str, offline: bool) -> list[str]:
    known = [*REGISTRY, *OFFLINE_ONLY] if offline else list(REGISTRY)
    if name == "all":
        return known
    if name not in known:
        where = "" if offline or name not in OFFLINE_ONLY else " (a yardstick: offline only)"
        raise UsageError(f"unknown policy {name!r}{where} (known: {', '.join(known)})")
    return [name]


def run_offline(
    reqs: list[ReplayRequest],
    fleet: FleetSpec,
    policy: str,
    reference: float,
    load_factor: float | None = None,
    gateways: GatewaySpec | None = None,
    progress: Callable[[int], None] | None = None,
    flow: FlowDriver | None = None,
    slo_ttft_s: float = 2.0,
) -> dict[str, object]:
    cfg = RouterConfig(policy=policy)
    if load_factor is not None:
        cfg = RouterConfig(policy=policy, load_factor=load_factor)
    spec = gateways or GatewaySpec()
    res = replay_offline(reqs, fleet, cfg, spec, progress=progress, flow=flow)
    out = summarize(
        policy=policy,
        outcomes=res.outcomes,
        replicas=res.replicas,
        hit_rate=res.hit_rate,
        pooled_reference_hit_rate=reference,
        preemptions=res.preemptions,
        load_factor=cfg.load_factor,
        load_slack=cfg.load_slack,
    )
    out["gateways"] = spec.gateways
    out["shared"] = spec.share and spec.gateways > 1
    out["sync_delay_ms"] = round(spec.sync_delay_s * 1000.0, 3) if out["shared"] else None
    out["gateway_seed"] = spec.seed if spec.gateways > 1 else None
    # contested picks held (`Router.defer_s`; `--no-defer`, and flow control, take turns)
    out["held_picks"] = (spec.defer and flow is None) if out["shared"] else None
    out.update(flow_report(reqs, res.outcomes, flow, slo_ttft_s))  # tiers, tenants, flow
    return out


def _sim_args(args: argparse.Namespace) -> list[str]:
    blocks = args.kv_tokens // 16
    return [
        "--preset",
        args.profile,
        "--num-gpu-blocks",
        str(blocks),
        "--max-model-len",
        str(min(131_072, args.kv_tokens - 16)),
        "--time-scale",
        str(args.time_scale),
    ]


def _run_live(
    args: argparse.Namespace, reqs: list[ReplayRequest], policy: str, ref: float
) -> dict[str, object]:
    if args.spawn:
        with Fleet() as fleet:
            urls = [fleet.sim(SPAWN_MODEL, *_sim_args(args)) for _ in range(args.replicas)]
            base = fleet.gateway(urls, "--policy", policy)
            return _live_once(args, reqs, policy, ref, base, urls, SPAWN_MODEL)
    root = args.target.rstrip("/")
    if root.endswith("/v1"):  # the replay adds /v1/...: /v1/v1/models was a bare 404
        raise ReplayError(f"--target {args.target}: the gateway's address, without /v1 (the "
                          f"clients' base URL): --target {root.removesuffix('/v1')}")
    return _live_once(args, reqs, policy, ref, args.target, args.replica, args.model)


def _live_once(
    args: argparse.Namespace,
    reqs: list[ReplayRequest],
    policy: str,
    ref: float,
    base: str,
    replicas: list[str],
    model: str | None,
) -> dict[str, object]:
    model = model or _first_model(base, args.api_key)
    target = LiveTarget(base, model, args.time_scale, args.api_key)
    progress = Progress(f"policy {policy}", len(reqs))
    outcomes, delta = asyncio.run(replay_live(reqs, target, replicas, progress.step))
    progress.close()
    # no replica's counters read (no --replica given): not measured, not a measured 0
    hit = delta.hits / delta.queries if delta.queries else None
    names = sorted({o.replica for o in outcomes})
    cfg = RouterConfig()
    out = summarize(
        # a --target gateway routes with its own policy: the row is not --policy's
        policy=policy if args.spawn else "target",
        outcomes=outcomes,
        replicas=names,
        hit_rate=hit,
        pooled_reference_hit_rate=ref,
        preemptions=int(delta.preemptions),
        load_factor=cfg.load_factor,
        load_slack=cfg.load_slack,
    )
    out["mode"] = "live"
    return out


def _first_model(base: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise ReplayError(f"target {base} is unreachable ({type(exc).__name__})") from None
    if resp.status_code != 200:
        hint = " (give --api-key)" if resp.status_code == 401 else ""
        raise ReplayError(f"target {base}: GET /v1/models answered {resp.status_code}{hint}")
    names = [m.get("id") for m in resp.json().get("data", [])]
    if not names:
        raise ReplayError(f"target {base} lists no model (give --model)")
    return str(names[0])


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except UsageError as exc:
        print(f"kvgate replay: {exc}", file=sys.stderr)
        return 2
    except ReplayError as exc:
        print(f"kvgate replay: {exc}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    policies = _check_args(args)
    try:
        reqs = tiers.shape(args, _workload(args))  # --tier-mix, --noisy-tenant
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    fleet = FleetSpec(replicas=args.replicas, kv_tokens=args.kv_tokens, profile=args.profile)
    # the replicas' context: offline and --spawn know it (a --target's replicas may differ)
    at_target = args.target and not (args.offline or args.spawn)
    context = None if at_target else fleet.engine_config().max_model_len
    ref = pooled_reference_hit_rate(reqs, args.replicas * args.kv_tokens, fleet.block_size,
                                    context)
    summaries = []
    for policy in policies:
        if args.offline:
            progress = Progress(f"policy {policy}", len(reqs))
            progress.note(f"offline replay of {len(reqs)} requests in simulated time")
            gateways = GatewaySpec(args.gateways, not args.no_share, args.sync_delay_ms / 1e3,
                                   args.gateway_seed, not args.no_defer)
            flow = (FlowDriver(flow_spec(args.flow_max_inflight))
                    if args.flow_control == "on" else None)
            summary = run_offline(reqs, fleet, policy, ref, gateways=gateways,
                                  progress=progress.step, flow=flow,
                                  slo_ttft_s=args.slo_ttft_s)
            progress.close()
            summary["mode"] = "offline"
        else:
            summary = _run_live(args, reqs, policy, ref)
        summaries.append(summary)
    against_oracle(summaries)
    print(format_table(summaries))
    if args.json is not None:
        path = args.json
        try:
            path.write_bytes(orjson.dumps(summaries, option=orjson.OPT_INDENT_2))
        except OSError as exc:
            raise ReplayError(f"--json {path}: {exc.strerror or exc}") from None
        print(f"kvgate replay: summaries written to {path}", file=sys.stderr)
    return report_failures(summaries) if summaries else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
