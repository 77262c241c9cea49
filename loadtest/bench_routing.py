"""Micro-benchmark of the routing core: `python -m loadtest.bench_routing [--quick]`.

Prints, for 16 replicas (``--replicas 4,16,64``: each count in turn) and 4k-token
(16k-character) chat prompts:
- feature extraction (canonical text + chained block hashes) in µs per request;
- `Router.pick` alone, per policy, in µs, on a warm index (every replica holds prefixes);
- pick + features (what the gateway pays per decision) and `record_route`;
and the affinity index's memory after 1M distinct prefixes (tracemalloc), bounded by capacity.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections.abc import Callable

from routing.config import RouterConfig
from routing.features import extract_features
from routing.index import AffinityIndex
from routing.policies import REGISTRY
from routing.router import Router
from routing.types import ReplicaView, RequestFeatures

REPLICAS = 16
PROMPT_CHARS = 16_000  # 4,000 tokens under routing.tokens


def _body(i: int) -> dict[str, object]:
    system = "You are a careful assistant for the ACME support desk. " * 40  # ~2.2k chars
    user = f"ticket {i}: " + "the printer on floor three prints blank pages again. " * 300
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user[: PROMPT_CHARS - len(system)]},
        ],
    }


def _per_call_us(fn: Callable[[int], object], n: int) -> float:
    fn(0)
    best = float("inf")
    for _ in range(3):  # best of three: the machine is shared
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def _views(replicas: int) -> list[ReplicaView]:
    return [
        ReplicaView(
            id=f"10.0.0.{i}:8000",
            pool="p",
            inflight=i % 5,
            inflight_prefill_tokens=(i % 5) * 3000,
            waiting=float(i % 3),
            running=4.0,
            kv_usage=0.5 + i / (2.5 * replicas),  # 0.5 up to 0.9
            scrape_age_s=0.1,
            cache_capacity_tokens=262_144,
        )
        for i in range(replicas)
    ]


def _bench_policy(
    policy: str,
    bodies: list[dict[str, object]],
    feats: list[RequestFeatures],
    views: list[ReplicaView],
    n: int,
) -> tuple[float, float]:
    cfg = RouterConfig(policy=policy)
    router = Router(cfg)
    for i, f in enumerate(feats):  # warm: every replica holds some prefixes
        router.record_route(views[i % len(views)].id, f, 0.0)

    def pick(i: int) -> object:
        return router.pick(feats[i % 64], views, 1.0)

    def both(i: int) -> object:
        f = extract_features(bodies[i % 64], model="m", salt="tenant", config=cfg)
        return router.pick(f, views, 1.0)

    return _per_call_us(pick, n), _per_call_us(both, n)


def bench_decisions(n: int, replicas: int = REPLICAS) -> None:
    cfg = RouterConfig()
    bodies = [_body(i) for i in range(64)]
    feats = [extract_features(b, model="m", salt="tenant", config=cfg) for b in bodies]
    print(
        f"prompt: {feats[0].prompt_tokens} tokens, {len(feats[0].block_hashes)} blocks; "
        f"{replicas} replicas"
    )
    us = _per_call_us(
        lambda i: extract_features(bodies[i % 64], model="m", salt="tenant", config=cfg), n
    )
    print(f"features (canonical text + hashes):   {us:7.1f} µs")
    views = _views(replicas)
    for policy in sorted(REGISTRY):
        pick, both = _bench_policy(policy, bodies, feats, views, n)
        print(f"{policy:16s} pick {pick:6.1f} µs   features+pick {both:6.1f} µs")
    router = Router()
    rec = _per_call_us(lambda i: router.record_route(views[i % replicas].id, feats[i % 64], 1.0), n)
    explain = _per_call_us(lambda i: router.pick(feats[i % 64], views, 1.0, explain=True), n // 4)
    print(f"record_route {rec:.1f} µs; cache_aware pick with explain {explain:.1f} µs")


def bench_memory(prefixes: int, blocks_per_prefix: int) -> None:
    cfg = RouterConfig()
    capacity = cfg.fallback_capacity_tokens // cfg.tokens_per_block
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = AffinityIndex(capacity)
    h = 1
    for p in range(prefixes):
        chain = list(range(h, h + blocks_per_prefix))
        h += blocks_per_prefix
        index.insert(f"10.0.0.{p % REPLICAS}:8000", chain)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    entries = sum(index.entries(r) for r in index.replicas())
    print(
        f"index after {prefixes:,} distinct prefixes x {blocks_per_prefix} blocks "
        f"({REPLICAS} replicas x {capacity:,} blocks capacity): {entries:,} entries, "
        f"{used / 2**20:.1f} MiB ({used / max(1, entries):.0f} B/entry)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_routing", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer iterations, 100k prefixes")
    ap.add_argument("--replicas", default=str(REPLICAS),
                    help="replica counts to bench the decisions at, comma-separated (default 16)")
    args = ap.parse_args()
    for replicas in (int(r) for r in args.replicas.split(",")):
        bench_decisions(300 if args.quick else 3000, replicas)
    bench_memory(100_000 if args.quick else 1_000_000, 4)
    print("(best of 3 runs, single thread; figures from a shared machine vary)")


if __name__ == "__main__":
    main()
