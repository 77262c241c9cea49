"""Chaos soak: mixed faults under steady load, then check nothing is stuck, lost or leaked.

    python -m loadtest.chaos [--seconds 120] [--seed N] [--clients 12] [--settle 15]

On 127.0.0.1: one redis-server (persistent), 4 simulated replicas in 2 pools, 2 gateways
sharing routing state through the Redis, tenants with keys on two tiers (free: tight limits,
one tenant over them). Steady traffic from the official openai client (async: chat and
completions, streamed and not, growing conversations, streams left after two chunks) while a
seeded schedule injects, one after the other: a replica SIGKILLed and restarted on its port,
a replica SIGSTOPped for a few seconds, Redis SIGKILLed and restarted, Redis SIGSTOPped, a
gateway SIGTERMed and started again, admin writes (a tier's limits changed, a key revoked, a
replica removed and added back). Then the load stops, a settle, a probe batch of requests, and
the invariants are checked and printed as a table (`loadtest.chaos_check`). Exit status 1
when one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from gateway.tenancy.salts import SaltDeriver
from loadtest.chaos_check import (
    Check,
    ended,
    footprint,
    gateway_state,
    leases,
    logs_clean,
    resources,
    revoked_refused,
    settled_5xx,
    timeline,
)
from loadtest.chaos_faults import Faults
from loadtest.chaos_load import Load, Tenant
from loadtest.chaos_procs import ADMIN, SALT, Procs
from loadtest.cmdline import positive, shown_command

__all__ = ["main"]

_AUTH = {"Authorization": f"Bearer {ADMIN}"}


def make_tenants(base: str) -> tuple[list[Tenant], list[str]]:
    """Six tenants (premium and free, one free tenant at 30 rpm: over its limit); their keys
    and the salts derived for them (secrets the logs must not hold)."""
    tenants, salts = [], []
    deriver = SaltDeriver(SALT)
    with httpx.Client(base_url=f"{base}/admin", headers=_AUTH, timeout=30) as a:
        for i in range(6):
            tier = "premium" if i % 2 == 0 else "free"
            body: dict[str, object] = {"id": f"t{i}", "tier": tier}
            if i == 5:
                body["limits"] = {"rpm": 30}
            made = a.post("/tenants", json=body).json()
            key = a.post(f"/tenants/t{i}/keys").json()
            tenants.append(Tenant(f"t{i}", tier, key["key"], key["id"]))
            salts.append(deriver.derive(f"tenant:t{i}", int(made["salt_epoch"])))
    return tenants, salts


async def _drive(load: Load, faults: Faults, seconds: float) -> None:
    runner = asyncio.create_task(load.run())
    await faults.run(seconds * 0.85)
    left = seconds - (time.monotonic() - load.t0)
    if left > 0:
        await asyncio.sleep(left)
    load.stop.set()
    await runner


async def _probe(bases: list[str], tenants: list[Tenant], seed: int) -> Load:
    """After the settle: every valid key through every gateway, a few of each kind."""
    good = [t for t in tenants if not t.revoked and t.id != "t5"]
    load = Load(bases, good, random.Random(seed), clients=4, think_s=0.0, limit=40)
    await load.run()
    return load


def run(seconds: float, seed: int, clients: int, settle: float, keep: bool) -> list[Check]:
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="kvgate-chaos-")
    if keep:
        print("logs kept in", tmp, flush=True)
    with contextlib.ExitStack() as stack:
        if not keep:
            stack.callback(shutil.rmtree, tmp, True)
        procs = Procs(Path(tmp))
        try:
            procs.start()
            bases = procs.bases()
            tenants, salts = make_tenants(bases[0])
            time.sleep(2)
            before = [footprint(g.pid) for g in procs.gateways]
            load = Load(bases, tenants, random.Random(rng.random()), clients=clients)
            faults = Faults(procs, tenants, random.Random(rng.random()))
            asyncio.run(_drive(load, faults, seconds))
            time.sleep(settle)
            probe = asyncio.run(_probe(bases, tenants, seed))
            time.sleep(2)
            checks = ended(load.records, {t.id for t in tenants if t.revoked})
            checks.append(revoked_refused(load.records, load.t0, tenants))
            checks += [(f"after the settle: {n}", ok, d)
                       for n, ok, d in ended(probe.records, set())[:3]]
            checks.append(settled_5xx(probe.records))
            for b in bases:
                checks += gateway_state(b)
            # a restarted gateway is a new process: its figures say nothing of the old one
            checks += [resources(g.name, b, footprint(g.pid))
                       for g, b in zip(procs.gateways, before, strict=True) if g.starts == 1]
            checks.append(leases(procs.redis_url))
            secrets = [ADMIN, SALT, *salts, *(t.key for t in tenants)]
            checks += logs_clean(procs.gateways, secrets, [*load.records, *probe.records])
            _report(seed, load, probe, faults.log, checks)
            return checks
        finally:
            procs.stop()


def _report(seed: int, load: Load, probe: Load, faults: list[str], checks: list[Check]) -> None:
    print(f"\nseed {seed}: {len(load.records)} requests under faults, "
          f"{len(probe.records)} after the settle")
    for outcome, n in sorted(load.summary().items(), key=lambda kv: -kv[1]):
        print(f"  {n:6d}  {outcome}")
    print("  after the settle:", dict(probe.summary()))
    print("  errors other than 401/429, per 5 s:", timeline(load.records))
    said = Counter(f"{r.outcome}: {r.message[:110]}" for r in load.records
                   if r.outcome not in ("ok", "cancelled"))
    for line, n in said.most_common(6):
        print(f"  {n:6d}  {line}")
    print("  faults:\n   ", "\n    ".join(faults))
    print("\n| invariant | pass | detail |\n|---|---|---|")
    for name, ok, detail in checks:
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=positive(float), default=120.0, help="seconds of load")
    p.add_argument("--seed", type=int, default=1, help="the fault schedule's and load's seed")
    p.add_argument("--clients", type=positive(int), default=12, help="concurrent clients")
    p.add_argument("--settle", type=positive(float, zero=True), default=15.0,
                   help="seconds after the load before the checks")
    p.add_argument("--keep", action="store_true", help="keep the processes' logs")
    args = p.parse_args(argv)
    print(shown_command("loadtest.chaos", argv), flush=True)
    checks = run(args.seconds, args.seed, args.clients, args.settle, args.keep)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
