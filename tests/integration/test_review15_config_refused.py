"""A Redis that refuses CONFIG to kvgate's user (an ACL user without +config, a managed
Redis that renamed or disabled the command) cannot say its eviction policy: the store asks
once and not every minute after. Each refusal was an entry in Redis's ACL LOG (128 entries
by default, what operators read for denied commands): one per gateway per minute, crowding
out the real ones. Real redis-server with a real ACL user; the listener's periodic read
called as it calls it."""

from __future__ import annotations

from typing import Any

import redis

from gateway.tenancy.redis_conn import connect_redis
from gateway.tenancy.redis_store import RedisStore
from tests.support.procs import Proc, free_port, redis_proc

PASSWORD = "review15-admin-password"


def _config_denials(port: int) -> int:
    admin = redis.Redis(port=port, password=PASSWORD)
    entries: list[dict[str, Any]] = admin.acl_log()
    return sum(int(e["count"]) for e in entries
               if str(e.get("object", "")).startswith("config"))


async def test_a_refused_config_is_not_asked_again() -> None:
    port = free_port()
    proc, _ = redis_proc(port)
    with Proc([*proc.cmd, "--requirepass", PASSWORD], ready_port=port):
        redis.Redis(port=port, password=PASSWORD).acl_setuser(
            "kvgate", enabled=True, passwords=["+kvgate-pw"], keys=["~*"], channels=["*"],
            commands=["+@all", "-config"])
        store = RedisStore(connect_redis(f"redis://kvgate:kvgate-pw@127.0.0.1:{port}/0"),
                           listen=False)
        try:
            await store.start()
            assert store.evicting is None  # cannot tell: not degraded
            assert _config_denials(port) == 1
            for _ in range(3):
                await store._say_if_evicting()  # the listener's read every minute
            assert store.evicting is None
            assert _config_denials(port) == 1
        finally:
            await store.close()
