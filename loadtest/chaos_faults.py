"""The seeded fault schedule of `loadtest.chaos`: process faults (SIGKILL and restart on the
same port, SIGSTOP/SIGCONT, SIGTERM and restart) and admin policy writes, spread over the run
in an order and at times drawn from the seed. The three lanes (Redis, other processes, admin)
run side by side; in a lane every fault heals itself before the next one."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from loadtest.chaos_load import Tenant
from loadtest.chaos_procs import ADMIN, Child, Procs

__all__ = ["FAULTS", "Faults"]

# three lanes run side by side, so faults meet: an admin write or a gateway's restart while
# Redis is stopped, a replica removed while another is killed
REDIS = ["redis-kill", "redis-stop"]
PROCESS = ["replica-kill", "replica-stop", "gateway-term"]
ADMIN_WRITES = ["tier-limits", "key-revoke", "replica-remove"]
FAULTS = REDIS + PROCESS + ADMIN_WRITES


@dataclass
class Faults:
    procs: Procs
    tenants: list[Tenant]
    rng: random.Random
    log: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def _say(self, what: str) -> None:
        line = f"{time.monotonic() - self.t0:6.1f}s {what}"
        self.log.append(line)
        print("  fault", line, flush=True)

    async def run(self, seconds: float) -> None:
        await asyncio.gather(*(self._lane(lane, seconds) for lane in (REDIS, PROCESS,
                                                                       ADMIN_WRITES)))

    async def _lane(self, names: list[str], seconds: float) -> None:
        order = names[:]
        self.rng.shuffle(order)
        slot = seconds / (len(order) + 1)
        for i, name in enumerate(order):
            at = slot * (i + 0.5) + self.rng.uniform(0, slot * 0.5)
            await asyncio.sleep(max(0.0, at - (time.monotonic() - self.t0)))
            act: Callable[[], Awaitable[None]] = getattr(self, "_" + name.replace("-", "_"))
            try:
                await act()
            except Exception as exc:
                self._say(f"{name} failed: {type(exc).__name__}: {exc}")

    async def _kill_restart(self, child: Child, sig: int, down_s: float) -> None:
        self._say(f"{child.name} {signal.Signals(sig).name}")
        child.signal(sig)
        await asyncio.to_thread(child.wait)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(child.start)
        self._say(f"{child.name} started again")

    async def _freeze(self, child: Child, stopped_s: float) -> None:
        self._say(f"{child.name} SIGSTOP for {stopped_s:.1f}s")
        child.signal(signal.SIGSTOP)
        await asyncio.sleep(stopped_s)
        child.signal(signal.SIGCONT)
        self._say(f"{child.name} SIGCONT")

    async def _replica_kill(self) -> None:
        await self._kill_restart(self.rng.choice(self.procs.sims), signal.SIGKILL, 2.0)

    async def _replica_stop(self) -> None:
        await self._freeze(self.rng.choice(self.procs.sims), self.rng.uniform(3, 6))

    async def _redis_kill(self) -> None:
        await self._kill_restart(self.procs.redis, signal.SIGKILL, 2.0)

    async def _redis_stop(self) -> None:
        await self._freeze(self.procs.redis, self.rng.uniform(3, 6))

    async def _gateway_term(self) -> None:
        await self._kill_restart(self.rng.choice(self.procs.gateways), signal.SIGTERM, 1.0)

    async def _admin(self, method: str, path: str, json: object | None = None) -> int:
        """One admin write through a gateway, retried (a gateway or Redis may be down)."""
        status = 0
        for attempt in range(20):
            base = self.procs.bases()[attempt % len(self.procs.bases())]
            try:
                async with httpx.AsyncClient(timeout=10) as c:
                    r = await c.request(method, f"{base}/admin{path}", json=json,
                                        headers={"Authorization": f"Bearer {ADMIN}"})
                status = r.status_code
                if status < 500:
                    break
            except httpx.HTTPError:
                status = 0
            await asyncio.sleep(0.5)
        self._say(f"admin {method} {path} -> {status}")
        return status

    async def _tier_limits(self) -> None:
        rpm = self.rng.choice([300, 900])
        await self._admin("PATCH", "/policy", {"tiers": {"free": {"limits": {
            "rpm": rpm, "max_concurrency": self.rng.choice([3, 8])}}}})

    async def _key_revoke(self) -> None:
        t = self.rng.choice([t for t in self.tenants if not t.revoked])
        t.revoked = True  # its 401s are expected from now on
        if await self._admin("DELETE", f"/tenants/{t.id}/keys/{t.key_id}") == 204:
            t.revoked_at = time.monotonic()

    async def _replica_remove(self) -> None:
        pool = self.rng.choice(["fp8", "awq"])
        sims = self.procs.sims[:2] if pool == "fp8" else self.procs.sims[2:]
        urls = [s.probe.removesuffix("/health") for s in sims]
        keep = self.rng.choice(urls)
        await self._admin("PATCH", "/policy", {"pools": {pool: {"replicas": [keep]}}})
        await asyncio.sleep(self.rng.uniform(3, 6))
        await self._admin("PATCH", "/policy", {"pools": {pool: {"replicas": urls}}})
