"""How an admin write's cost grows with the keys already made: a real gateway (in-memory store,
or a throwaway redis-server) gets N `POST /admin/tenants/acme/keys` one by one; prints the
median time per write over the first and the last 100, and the total. With ``--deletes M``,
then M tenants of one key each are made and deleted one by one: the median time per
`DELETE /admin/tenants/{id}` with the N keys in the store (a deletion's reload).

    python -m loadtest.bench_admin_writes memory|redis [N] [--deletes M]
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


def main(store: str, n: int, deletes: int = 0) -> None:
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
        gone = _deletions(admin, deletes)
    first, last = (statistics.median(part) * 1e3 for part in (times[:100], times[-100:]))
    print(f"{store}: {n} keys one by one: first 100 {first:.2f} ms/write (median), last 100 "
          f"{last:.2f} ms/write, ratio {last / first:.1f}x, total {sum(times):.1f} s")
    if gone:
        print(f"{store}: {deletes} tenants of one key deleted one by one beside {n} keys: "
              f"{statistics.median(gone) * 1e3:.2f} ms/delete (median)")


def _deletions(admin: httpx.Client, m: int) -> list[float]:
    """Make `m` tenants of one key each, then delete them one by one: each delete's time."""
    for i in range(m):
        assert admin.post("/tenants", json={"id": f"gone{i}", "tier": "default"}
                          ).status_code == 201
        assert admin.post(f"/tenants/gone{i}/keys").status_code == 201
    times = []
    for i in range(m):
        t0 = time.perf_counter()
        r = admin.delete(f"/tenants/gone{i}")
        times.append(time.perf_counter() - t0)
        assert r.status_code == 204, r.text
    return times


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_admin_writes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("store", nargs="?", choices=("memory", "redis"), default="memory",
                        help="the tenancy store (default memory; redis needs redis-server)")
    parser.add_argument("n", nargs="?", type=int, default=2000,
                        help="keys made one by one (default 2000; at least 100)")
    parser.add_argument("--deletes", type=int, default=0, metavar="M",
                        help="then make and delete M tenants of one key each (default 0)")
    args = parser.parse_args()
    if args.n < 100:
        parser.error("n must be at least 100 (the first and the last 100 are compared)")
    main(args.store, args.n, args.deletes)
