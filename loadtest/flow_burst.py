"""A burst through one gateway or several sharing state (one Redis) in front of the same
simulated replicas, flow control on with a small in-flight bound: how many requests each
replica ends up holding against the bound.

The replicas' streams hang after two tokens, so nothing frees during the burst: the requests a
replica received by the end of the burst are its peak in flight. ``python -m loadtest.flow_burst
[--rounds N] [--burst N] [--json OUT]`` prints, per layout, each round's per-replica counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import httpx
import openai

from loadtest.fleet import Fleet, environ, redis_server

__all__ = ["burst_once", "main"]

MODEL = "m"
LIMIT = 2  # flow.max_inflight per replica
REPLICAS = 2
# a prompt of several prefix blocks: its route is published at once (a prompt shorter than a
# block has no route, and its load reaches the peers with the next heartbeat)
PROMPT = " ".join(f"word{k}" for k in range(120))


async def _fire(bases: list[str], sims: list[str], n: int, prompt: str
                ) -> tuple[list[int], list[int]]:
    """``n`` streams at once, split evenly over ``bases``: what each replica received once
    every one of them has arrived (the replicas hold some, the gateways queue the rest), and
    what each received once the clients all left (the queued ones must never be sent)."""
    clients = [openai.AsyncOpenAI(base_url=f"{b}/v1", api_key="x", max_retries=0, timeout=60)
               for b in bases]

    async def one(i: int) -> Any:
        return await clients[i % len(clients)].chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"burst {i}: " + prompt}],
            max_tokens=50, stream=True)

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    await asyncio.sleep(3.0)  # every request has arrived and the gateways' records settled
    held = await asyncio.to_thread(_held, sims)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in clients:
        await c.close()
    await asyncio.sleep(2.0)
    return held, await asyncio.to_thread(_held, sims)


def _held(sims: list[str]) -> list[int]:
    return [int(httpx.get(f"{s}/sim/stats", timeout=5).json()["received"]) for s in sims]


def burst_once(gateways: int, burst: int, peer_lag_ms: float | None = None,
               prompt: str = PROMPT) -> tuple[list[int], list[int]]:
    """One burst of ``burst`` streams through ``gateways`` fresh gateways on a fresh Redis:
    what each replica received by its end, and once its clients had left (`_fire`)."""
    with redis_server() as url:
        return _burst(gateways, burst, url, peer_lag_ms, prompt)


def _burst(gateways: int, burst: int, redis_url: str, peer_lag_ms: float | None,
           prompt: str) -> tuple[list[int], list[int]]:
    env = {"KVGATE_FLOW__ENABLED": "true", "KVGATE_FLOW__MAX_INFLIGHT": str(LIMIT),
           "KVGATE_FLOW__MAX_QUEUE": "1000", "KVGATE_REDIS_URL": redis_url, "KVGATE_CONFIG": ""}
    if peer_lag_ms is not None:
        env["KVGATE_FLOW__PEER_LAG_MS"] = str(peer_lag_ms)
    with environ(env), Fleet(quiet=os.environ.get("FLOW_BURST_VERBOSE") is None) as fleet:
        sims = [fleet.sim(MODEL, "--hang-after-tokens", "2", "--time-scale", "50")
                for _ in range(REPLICAS)]
        bases = [fleet.gateway(sims, "--log-level", "warning") for _ in range(gateways)]
        for base in bases if gateways > 1 else ():
            _see_each_other(base, gateways - 1)
        return asyncio.run(_fire(bases, sims, burst, prompt))


def _see_each_other(base: str, peers: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/readyz", timeout=5).json().get("sync", {}).get("peers") == peers:
            return
        time.sleep(0.1)
    raise TimeoutError("the gateways did not see each other")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst", type=int, default=40)
    p.add_argument("--peer-lag-ms", type=float, help="flow.peer_lag_ms (default: unset)")
    p.add_argument("--short", action="store_true",
                   help="one-word prompts (no prefix block: no routing record of their own)")
    p.add_argument("--label", default="this commit", help="the runs' name in --json")
    p.add_argument("--json", help="add the counts to this file (kept: other labels' runs)")
    p.add_argument("--figure", help="draw the runs of --json into this PNG, and stop")
    args = p.parse_args(argv)
    if args.figure:
        figure(args.json, args.figure)
        return
    out: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for n in (1, 2):
            held, after = burst_once(n, args.burst, args.peer_lag_ms,
                                     "x" if args.short else PROMPT)
            out.setdefault(f"{n}", []).append(held)
            out.setdefault(f"{n} left", []).append(after)
            print(f"{n} gateway(s): per replica {held} (bound {LIMIT} each), {after} "
                  "once the clients had left", flush=True)
    if args.json:
        saved: dict[str, Any] = {}
        if os.path.exists(args.json):
            with open(args.json) as f:
                saved = json.load(f)
        saved.update({"limit": LIMIT, "replicas": REPLICAS, "burst": args.burst,
                      "title": "one-word prompts" if args.short else "120-word prompts"})
        saved.setdefault("runs", {})[args.label] = out
        with open(args.json, "w") as f:
            json.dump(saved, f, indent=1)


def figure(paths: str, png: str) -> None:
    """Per run (``paths``: JSON files, comma-separated, one panel each) and label, the peak a
    replica held in each round's burst, one gateway against two."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = paths.split(",")
    fig, axes = plt.subplots(1, len(files), figsize=(6.5 * len(files), 3.8), squeeze=False)
    for ax, path in zip(axes[0], files, strict=True):
        with open(path) as f:
            data = json.load(f)
        labels = list(data["runs"])
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            runs = data["runs"][label]
            for x, n in enumerate(("1", "2")):
                peaks = [max(r) for r in runs.get(n, [])]
                if peaks:
                    ax.bar(x + i * width, sum(peaks) / len(peaks), width, color=f"C{i}",
                           label=label if x == 0 else None)
                    ax.plot([x + i * width] * len(peaks), peaks, "k.", markersize=5)
        ax.axhline(data["limit"], color="red", linestyle="--", label="the bound")
        ax.set_xticks([w + 0.4 - width / 2 for w in (0, 1)],
                      ["one gateway", "two gateways (one Redis)"])
        ax.set_ylabel("most requests a replica held")
        ax.set_title(f"{data.get('title', '')}: {data['burst']} streams, max_inflight "
                     f"{data['limit']} x {data['replicas']} replicas", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
