"""The test Redis servers keep their files to themselves: one started in the repository
loaded any dump.rdb there (a replica in test_redis_causes.py wrote one, holding
kvgate:routes as a string), and every later test's Redis began with those keys."""

from __future__ import annotations

import subprocess

from tests.support.procs import ROOT, redis_proc


def test_a_test_redis_works_outside_the_repository() -> None:
    proc, url = redis_proc()
    with proc:
        port = url.rsplit(":", 1)[1].split("/")[0]
        out = subprocess.run(["redis-cli", "-p", port, "CONFIG", "GET", "dir"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    where = out.split()[1]
    assert where != str(ROOT) and not where.startswith(f"{ROOT}/"), where
