"""A Redis at its `maxclients` (many gateways and workers, a managed Redis's small limit)
refuses each new connection with an ERR reply. The log named only "server replied ERR";
it names the limit now, and the gateway joins once Redis takes connections again."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import httpx
import redis

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]


def test_a_redis_at_its_maxclients_is_named_and_joined_after(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    server = Proc([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--maxclients", "1"], ready_port=port)
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    gw, base = gateway_proc(config=config, env=env, auth=True, ready=False)
    with server:
        holder = redis.Redis(port=port)  # the one connection Redis takes
        try:
            assert holder.ping()
            with gw:
                # the tenancy store's line (the shared routing state's raw connection sends
                # no handshake: it finds the connection closed, "ConnectionError")
                def said() -> list[str]:
                    return [line for line in gw.output().splitlines()
                            if "refused by Redis" in line and "shared routing" not in line]
                wait_for(lambda: bool(said()), timeout=20, what="the line naming the refusal")
                assert "max number of clients reached" in said()[0], said()
                holder.config_set("maxclients", 1000)
                wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 200, timeout=20,
                         what="ready once Redis takes connections")
        finally:
            holder.close()
