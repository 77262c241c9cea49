"""Redis stops and comes back: tenancy keeps serving, says it is degraded, and recovers, and the
log says so in a few lines."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.errors import AuthError, BackendUnavailable
from gateway.policy_doc import Limits, parse_policy
from gateway.tenancy import (
    KeyRecord,
    RedisRateLimiter,
    RedisStore,
    SaltDeriver,
    TenancySettings,
    Tenant,
    TenantResolver,
    build_tenancy,
    connect_redis,
    generate_key,
    hash_key,
)
from tests.support.procs import Proc, free_port, redis_proc

SECRET = "outage-test-secret-0123456789abcdef"
POLICY = parse_policy(
    {
        "pools": {"p": {"served_model": "m-p", "replicas": ["http://127.0.0.1:9"]}},
        "models": {"m": {"default": "p"}},
        "tiers": {"premium": {"limits": {"rpm": 1000, "max_concurrency": 4}}},
    }
)


def _persistent_redis(data_dir: Path) -> tuple[Proc, str]:
    """redis-server with an append-only file, so a restart keeps the data (as in production)."""
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    cmd = [
        exe,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--dir",
        str(data_dir),
    ]
    return Proc(cmd, ready_port=port), f"redis://127.0.0.1:{port}/0"


async def _until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(20):
        while not cond():  # noqa: ASYNC110 - polling a condition with a deadline
            await asyncio.sleep(0.02)


async def test_outage_fallback_and_recovery(tmp_path: Path) -> None:
    proc, url = _persistent_redis(tmp_path)
    proc.start()
    settings = TenancySettings(gateway_replicas=2, poll_interval_s=0.1)
    tenancy = build_tenancy(settings, SECRET, url)
    try:
        await tenancy.start(tenants=[Tenant(id="acme", tier="premium")], policy=POLICY)
        key = generate_key()
        await tenancy.store.add_key(
            KeyRecord(key_id="k1", tenant_id="acme", key_hash=hash_key(key), created_at=0.0)
        )
        await _until(lambda: tenancy.resolver.health().generation >= 3)
        limits = tenancy.resolver.authenticate(key).limits
        shared = await tenancy.limiter.admit("acme", limits, tokens=1)
        assert shared.allowed and not shared.degraded

        proc.stop()
        await _until(lambda: tenancy.resolver.health().degraded)
        assert tenancy.resolver.authenticate(key).tenant_id == "acme"  # last known keys
        during = [await tenancy.limiter.admit("acme", limits, tokens=1) for _ in range(3)]
        assert all(a.degraded for a in during) and tenancy.limiter.degraded
        # per-process share of max_concurrency=4 over 2 replicas: 2 leases, the 3rd denied
        assert [a.allowed for a in during] == [True, True, False]
        for a in during:
            await tenancy.limiter.release(a)  # released locally, no error
        await tenancy.limiter.release(shared)  # Redis is down: tolerated, the lease expires

        proc.start()  # same port, same data directory
        await _until(lambda: not tenancy.resolver.health().degraded)
        for _ in range(200):  # the limiter re-tries Redis at most once a second
            after = await tenancy.limiter.admit("acme", limits, tokens=1)
            await tenancy.limiter.release(after)
            if not after.degraded:
                break
            await asyncio.sleep(0.05)
        assert not after.degraded and after.allowed and not tenancy.limiter.degraded

        await tenancy.store.revoke_key("acme", "k1")  # pub/sub and sync work again

        def revoked() -> bool:
            try:
                tenancy.resolver.authenticate(key)
            except AuthError:
                return True
            return False

        await _until(revoked)
    finally:
        await tenancy.close()
        proc.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_staleness_is_bounded_and_a_wiped_store_is_not_trusted() -> None:
    proc, url = redis_proc()
    proc.start()
    clock = Clock()
    store = RedisStore(connect_redis(url), namespace="stale")
    resolver = TenantResolver(
        store, SaltDeriver(SECRET), max_staleness_s=10, clock=clock, poll_interval_s=3600
    )
    try:
        await store.put_policy(POLICY)
        await store.create_tenant(Tenant(id="acme", tier="premium"))
        key = generate_key()
        await store.add_key(
            KeyRecord(key_id="k", tenant_id="acme", key_hash=hash_key(key), created_at=0.0)
        )
        await resolver.start()
        assert resolver.authenticate(key).tenant_id == "acme"
        proc.stop()
        assert await resolver.refresh() is False
        assert (resolver.health().reason or "").startswith("store unreachable: ")  # and why
        clock.now += 9
        assert resolver.authenticate(key).tenant_id == "acme"  # within the bound
        proc.start()  # no persistence: the restarted Redis is empty
        assert await resolver.refresh() is False
        assert "empty" in (resolver.health().reason or "")
        assert resolver.authenticate(key).tenant_id == "acme"  # last known state, not "nothing"
        clock.now += 2  # 11 s since the store last confirmed our state
        try:
            resolver.authenticate(key)
            raise AssertionError("stale state served beyond max_staleness_s")
        except BackendUnavailable as exc:
            assert exc.status == 503
    finally:
        await resolver.close()
        await store.close()
        proc.stop()


async def test_a_redis_that_never_answered_is_named_once_and_joined_when_it_comes_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wrong or not-yet-started Redis: one line naming the address and the OS error (not the
    password), a 503 that names the store, no repeated retry lines, and a line and a load
    when it comes up."""
    port = free_port()
    url = f"redis://:hunter2-secret@127.0.0.1:{port}/0"
    tenancy = build_tenancy(TenancySettings(poll_interval_s=0.1), SECRET, url)
    caplog.set_level(logging.INFO, logger="gateway.tenancy")
    proc, _ = redis_proc(port)
    proc = Proc([*proc.cmd, "--requirepass", "hunter2-secret"], ready_port=port)
    try:
        await tenancy.start(tenants=[Tenant(id="acme", tier="premium")], policy=POLICY)
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [f"cannot reach Redis at 127.0.0.1:{port} (connection refused); "
                         "retrying every 2 s"]
        try:
            tenancy.resolver.principal_for("acme")
            raise AssertionError("served without tenancy state")
        except BackendUnavailable as exc:
            assert exc.status == 503
            assert "the tenancy store (Redis) has not answered yet" in exc.message
        await asyncio.sleep(3)  # the listener retried several times meanwhile
        assert [r.getMessage() for r in caplog.records] == lines
        proc.start()
        await _until(lambda: tenancy.resolver.health().loaded)
        back = f"Redis at 127.0.0.1:{port} answers again"
        await _until(lambda: any(r.getMessage().startswith(back) for r in caplog.records))
        assert tenancy.resolver.principal_for("acme").tier == "premium"
        assert not any("hunter2" in r.getMessage() for r in caplog.records)
    finally:
        await tenancy.close()
        proc.stop()


async def test_lease_renewal_failures_are_named_once_and_their_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Live leases while Redis is away: one line for the failed renewals, not one per retry,
    and one when a renewal succeeds again."""
    port = free_port()
    proc, url = redis_proc(port)
    proc.start()
    limiter = RedisRateLimiter(connect_redis(url), namespace="renew", lease_ttl_s=0.3)
    caplog.set_level(logging.INFO, logger="gateway.tenancy")
    subject = "concurrency lease renewal: "

    def renewal_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(subject)]

    try:
        await limiter.start()
        lease = await limiter.admit("acme", Limits(max_concurrency=2), tokens=1)
        assert lease.allowed and lease.lease_id is not None
        proc.stop()
        await asyncio.sleep(1.5)  # about 15 renewals (every 0.1 s), all failed
        lines = renewal_lines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"{subject}cannot reach Redis at 127.0.0.1:{port} (")
        assert lines[0].endswith("); retrying every 0.1 s")
        proc.start()
        back = f"{subject}Redis at 127.0.0.1:{port} answers again"
        await _until(lambda: any(line.startswith(back) for line in renewal_lines()))
        assert len(renewal_lines()) == 2
    finally:
        await limiter.close()
        proc.stop()


async def test_an_outage_divides_limits_by_the_fleet_last_seen() -> None:
    """`gateway_replicas` says 1, but the shared routing state heard from 3 other processes
    before Redis stopped (an autoscaler added them): each then keeps a quarter of the budget,
    not all of it (4x the budget over the fleet)."""
    proc, url = redis_proc()
    proc.start()
    tenancy = build_tenancy(TenancySettings(poll_interval_s=0.1), SECRET, url)
    limiter = tenancy.limiter
    fleet = [4]
    limiter.processes = lambda: fleet[0]  # type: ignore[attr-defined]
    limits = Limits(rpm=8)
    try:
        await tenancy.start(tenants=[Tenant(id="acme", tier="premium")], policy=POLICY)
        first = await limiter.admit("acme", limits, tokens=1)  # Redis answers: sampled
        assert first.allowed and not first.degraded
        fleet[0] = 1  # the peers age out once Redis is gone: the last minute counts
        proc.stop()
        answers = [await limiter.admit("acme", limits, tokens=1) for _ in range(6)]
        assert all(a.degraded for a in answers)
        assert sum(a.allowed for a in answers) == 2  # 8 // 4
    finally:
        await tenancy.close()
        proc.stop()
