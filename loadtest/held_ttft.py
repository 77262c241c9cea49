"""TTFT of bursts over live gateways, held picks on vs off (`sync.hold_picks`).

    python -m loadtest.held_ttft [--gateways N] [--replicas R] [--bursts B] [--per K]
                                 [--flush-ms W] [--words M]

One redis-server; two fleets started side by side, each N `kvgate serve` over R `kvgate sim`
replicas of its own (a Redis namespace each): one holding contested picks, one not. Bursts
alternate between them (a shared machine's drift hits both alike): in a burst every gateway of
the fleet receives K streamed requests with new prompts of M words at one instant. TTFT is the
client's (request sent -> first content chunk), so a held pick's wait is in it; and how many
bursts put two of their requests on one replica (`x-kvgate-replica`)."""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from loadtest.fleet import Fleet

__all__ = ["main"]

MODEL = "sim-model"


def _config(dirname: str, name: str, replicas: list[str], hold: bool, flush_ms: float) -> str:
    path = Path(dirname) / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"p": {"replicas": replicas, "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}},
        "routing": {"policy": "cache_aware", "scrape_interval_ms": 100},
        "sync": {"flush_interval_ms": flush_ms, "hold_picks": hold},
        "tenancy": {"namespace": name},
    }))
    return str(path)


def _ttft(base: str, prompt: str, out: list[float], where: list[str]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        where.append(r.headers.get("x-kvgate-replica", ""))
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                out.append(time.perf_counter() - t0)
                return


def _burst(bases: list[str], per: int, words: int, rng: random.Random,
           out: list[float]) -> bool:
    """Whether two requests of the burst shared a replica."""
    threads, where = [], []  # type: ignore[var-annotated]
    for base in bases:
        for _ in range(per):
            prompt = " ".join(f"w{rng.getrandbits(40)}" for _ in range(words))
            threads.append(threading.Thread(target=_ttft, args=(base, prompt, out, where)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(set(where)) < len(where)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))] * 1e3 if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from loadtest.fleet import redis_server

    p = argparse.ArgumentParser(prog="python -m loadtest.held_ttft", description=__doc__)
    p.add_argument("--gateways", type=int, default=2, help="gateways per fleet (default 2)")
    p.add_argument("--replicas", type=int, default=3, help="replicas per fleet (default 3)")
    p.add_argument("--bursts", type=int, default=30, help="per variant (default 30)")
    p.add_argument("--per", type=int, default=2, help="requests per gateway per burst (default 2)")
    p.add_argument("--words", type=int, default=1500, help="words per prompt (default 1500)")
    p.add_argument("--flush-ms", type=float, default=20.0,
                   help="the gateways' sync.flush_interval_ms (default 20)")
    p.add_argument("--gap", type=float, default=1.0, help="seconds between bursts (default 1)")
    args = p.parse_args(argv)
    rng = random.Random(3)
    ttft: dict[bool, list[float]] = {True: [], False: []}
    shared = {True: 0, False: 0}  # bursts with two requests on one replica
    with redis_server() as url, tempfile.TemporaryDirectory() as tmp, Fleet() as fleet:
        os.environ["KVGATE_REDIS_URL"] = url
        bases: dict[bool, list[str]] = {}
        for hold in (True, False):
            name = "hold" if hold else "nohold"
            sims = [fleet.sim(MODEL) for _ in range(args.replicas)]
            cfg = _config(tmp, name, sims, hold, args.flush_ms)
            bases[hold] = [fleet.gateway([], "--config", cfg) for _ in range(args.gateways)]
        time.sleep(2.0)  # the gateways see each other
        for i in range(2 * args.bursts):
            hold = i % 2 == 0
            shared[hold] += _burst(bases[hold], args.per, args.words, rng, ttft[hold])
            time.sleep(args.gap)
    for hold, xs in ttft.items():
        print(f"hold_picks {str(hold).lower():5}: {len(xs)} requests, TTFT p50 "
              f"{statistics.median(xs) * 1e3:7.1f} p99 {_pct(xs, 0.99):7.1f} max "
              f"{_pct(xs, 1.0):7.1f} ms; {shared[hold]} of {args.bursts} bursts with two "
              f"requests on one replica", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
