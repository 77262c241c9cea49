"""A salt rotation through one gateway racing a PATCH of the same tenant through another (two
`kvgate serve` processes on one real redis-server): both land, whatever their order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway import shared_gateways
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "admin-token-0123456789abcdef"
HEADERS = {"authorization": f"Bearer {ADMIN}"}
ROUNDS = 30


@pytest.fixture(scope="module")
def gateways() -> Iterator[list[str]]:
    procs: list[Proc] = []
    try:
        rproc, url = redis_proc()
        procs.append(rproc.start())
        sim, sim_url = sim_proc()
        procs.append(sim.start())
        pools = {"p": {"served_model": "sim-model", "replicas": [sim_url]}}
        bases = shared_gateways(procs, url, ADMIN, {"pools": pools})
        yield bases
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.mark.parametrize("group", [None, "shared"])
async def test_a_rotation_and_a_patch_of_one_tenant_through_two_gateways_both_land(
    gateways: list[str], group: str | None,
) -> None:
    """Each round: `rotate-salt` through one gateway and a PATCH of the tenant's `rpm`
    through the other, at once. After it, the salt's epoch is one past the round's start
    and `rpm` is the round's value: neither write is lost to the other's."""
    a, b = gateways
    tid = f"race-{group or 'own'}"
    async with httpx.AsyncClient(headers=HEADERS, timeout=30) as c:
        created = await c.post(f"{a}/admin/tenants", json={"id": tid, "salt_group": group})
        assert created.status_code == 201, created.text
        for i in range(ROUNDS):
            before = (await c.get(f"{a}/admin/tenants/{tid}")).json()["salt_epoch"]
            rotated, patched = await asyncio.gather(
                c.post(f"{a}/admin/tenants/{tid}/rotate-salt"),
                c.patch(f"{b}/admin/tenants/{tid}", json={"limits": {"rpm": 100 + i}}))
            assert rotated.status_code == 200 and patched.status_code == 200, (
                rotated.text, patched.text)
            after = (await c.get(f"{b}/admin/tenants/{tid}")).json()
            assert after["salt_epoch"] == before + 1, (i, after)
            assert after["limits"]["rpm"] == 100 + i, (i, after)
            assert rotated.json()["salt_epoch"] == before + 1, (i, rotated.json())
