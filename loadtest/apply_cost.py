"""The CPU of applying peers' batches, per route, in one tree or two side by side.

    python -m loadtest.apply_cost [--tree DIR ...] [--requests N] [--rounds R] [--callgrind]

Captures the stream entries router ``gw1`` applies in `loadtest.sync_cost.simulate` (two routers
at 2,000 requests/s, 20 ms batches: decoding, index inserts, the policy's sessions, loads), then
applies them to a fresh router through `RouteSync._take`, as a reader does. Each tree (default:
this one) runs in its own process with that tree on its path, the capture included, so a tree
with another wire format decodes its own. Timed: the median of ``--rounds`` alternated runs,
µs per route applied. ``--callgrind``: instructions per route applied, deterministic (valgrind's
callgrind at half and all of the entries, PYTHONHASHSEED=0; the difference over the routes
between them, so start-up and warm-up cancel out).
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

_HERE = Path(__file__).resolve()
_ROOT = _HERE.parent.parent
_URL = "redis://127.0.0.1:1"  # never dialled
Entries = list[tuple[float, object]]  # (the receiver's clock, an XREAD reply)


# -- in the child: the tree under test is on the path --------------------------------------------
def _capture(requests: int, out: Path) -> None:
    from gateway.fleet.sync import RouteSync
    from loadtest.sync_cost import simulate

    got: Entries = []
    take = RouteSync._take

    def tapped(self: RouteSync, reply: object) -> int:
        if self.member == "gw1":
            got.append((self._clock(), reply))
        return take(self, reply)

    RouteSync._take = tapped  # type: ignore[method-assign]
    try:
        simulate(0.02, requests)
    finally:
        RouteSync._take = take  # type: ignore[method-assign]
    out.write_bytes(pickle.dumps(got))


def _apply(path: Path, count: int, reps: int) -> dict[str, float]:
    from gateway.fleet.records import decode
    from gateway.fleet.settings import SyncSettings
    from gateway.fleet.sync import RouteSync
    from routing.router import Router, RouterConfig

    entries: Entries = pickle.loads(path.read_bytes())[:count]
    routes = 0
    for _, reply in entries:
        for _, raw in reply:  # type: ignore[attr-defined]
            for _, flat in raw:
                routes += len(decode(dict(zip(flat[::2], flat[1::2], strict=True))).routes)
    settings = SyncSettings(flush_interval_s=0.02, catchup_entries=0)
    spent: list[float] = []
    clock = [0.0]
    for _ in range(reps):
        sync = RouteSync(Router(RouterConfig()), _URL, "bench", settings, own_loads=dict,
                         known=lambda r: True, clock=lambda: clock[0], member="gw1")
        t0 = time.process_time()
        for now, reply in entries:
            clock[0] = now
            sync._take(reply)
        spent.append(time.process_time() - t0)
    return {"routes": routes, "us_per_route": statistics.median(spent) / max(routes, 1) * 1e6}


# -- in the parent ---------------------------------------------------------------------------------
def _child(tree: Path, args: list[str], wrap: list[str] | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    cmd = [*(wrap or []), sys.executable, "-P", str(_HERE), *args]
    return subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout


def _instructions(tree: Path, path: Path, count: int, work: Path) -> tuple[int, int]:
    """(instructions, routes) of applying the first ``count`` entries, start-up included."""
    out = work / f"cg.{os.getpid()}.{count}"
    got = json.loads(_child(tree, ["apply", str(path), str(count), "1"],
                            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]))
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            out.unlink()
            return int(line.split()[1]), int(got["routes"])
    raise RuntimeError("no totals in callgrind's output")


def main(argv: list[str] | None = None) -> int:
    """Apply captured batches in each tree; µs (or instructions) per route applied."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "capture":
        _capture(int(argv[1]), Path(argv[2]))
        return 0
    if argv and argv[0] == "apply":
        print(json.dumps(_apply(Path(argv[1]), int(argv[2]), int(argv[3]))))
        return 0
    p = argparse.ArgumentParser(prog="python -m loadtest.apply_cost", description=main.__doc__)
    p.add_argument("--tree", action="append", type=Path,
                   help="a source tree to measure (repeat to compare; default: this one)")
    p.add_argument("--requests", type=int, default=12000, help="simulated requests to capture")
    p.add_argument("--rounds", type=int, default=5, help="timed runs per tree, alternated")
    p.add_argument("--reps", type=int, default=5, help="applications per timed run (median)")
    p.add_argument("--callgrind", action="store_true", help="count instructions instead")
    args = p.parse_args(argv)
    trees: list[Path] = args.tree or [_ROOT]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = []
        for i, tree in enumerate(trees):
            files.append(work / f"entries.{i}")
            _child(tree, ["capture", str(args.requests), str(files[-1])])
        n = len(pickle.loads(files[0].read_bytes()))
        if args.callgrind:
            for tree, path in zip(trees, files, strict=True):
                i0, r0 = _instructions(tree, path, n // 2, work)
                i1, r1 = _instructions(tree, path, n, work)
                print(f"{tree}: {(i1 - i0) / (r1 - r0):,.0f} instructions per route applied "
                      f"({r1 - r0} routes, entries {n // 2}..{n})", flush=True)
            return 0
        per: dict[Path, list[float]] = {t: [] for t in trees}
        for r in range(args.rounds):
            for tree, path in zip(trees, files, strict=True):
                got = json.loads(_child(tree, ["apply", str(path), str(n), str(args.reps)]))
                per[tree].append(got["us_per_route"])
                print(f"round {r} {tree}: {got['us_per_route']:.2f} us per route applied "
                      f"({got['routes']} routes)", flush=True)
        base = statistics.median(per[trees[0]])
        for tree, each in per.items():
            med = statistics.median(each)
            print(f"median {tree}: {med:.2f} us per route applied ({med / base:.3f}x the first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
