"""How an admin write's cost grows with the keys already made: a real gateway (in-memory store,
or a throwaway redis-server) gets N `POST /admin/tenants/acme/keys` one by one; prints the
median time per write over the first and the last 100, and the total.

    python -m loadtest.bench_admin_writes memory|redis [N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import httpx

from tests.support.gateway import AUTH_SECRET, gateway_proc
from tests.support.procs import redis_proc

ADMIN = "bench-admin-token-0123456789"
CONFIG = {"pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
          "models": {"llama": {"default": "p"}}, "tenants": [{"id": "acme", "tier": "default"}]}


def main(store: str, n: int) -> None:
    # the memory store needs no redis-server (the demo install has none)
    redis, url = redis_proc() if store == "redis" else (contextlib.nullcontext(), "")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url}
    gw, base = gateway_proc(config=CONFIG, env=env, auth=True, ready=False,
                            args=["--log-level", "warning"])
    with redis, gw, httpx.Client(base_url=f"{base}/admin", timeout=30,
                                 headers={"authorization": f"Bearer {ADMIN}"}) as admin:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = admin.post("/tenants/acme/keys")
            times.append(time.perf_counter() - t0)
            assert r.status_code == 201, r.text
    first, last = (statistics.median(part) * 1e3 for part in (times[:100], times[-100:]))
    print(f"{store}: {n} keys one by one: first 100 {first:.2f} ms/write (median), last 100 "
          f"{last:.2f} ms/write, ratio {last / first:.1f}x, total {sum(times):.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_admin_writes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("store", nargs="?", choices=("memory", "redis"), default="memory",
                        help="the tenancy store (default memory; redis needs redis-server)")
    parser.add_argument("n", nargs="?", type=int, default=2000,
                        help="keys made one by one (default 2000; at least 100)")
    args = parser.parse_args()
    if args.n < 100:
        parser.error("n must be at least 100 (the first and the last 100 are compared)")
    main(args.store, args.n)
