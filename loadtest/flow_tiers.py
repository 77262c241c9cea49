"""Tier priority behind two gateways sharing state: free tenants' clients on gateway B keep the
pool saturated, one premium client on gateway A sends request after request. How many
requests each tier had served, and the premium requests' waits in the queue (their
``x-kvgate-route: queued``), with flow control bounding one simulated replica.

``python -m loadtest.flow_tiers [--seconds S] [--peer-lag-ms MS]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

import httpx
import openai

from loadtest.fleet import Fleet, environ, free_port, redis_server

__all__ = ["main"]

ADMIN = "flow-tiers-probe-admin-token-0123456789"
SALT = "flow-tiers-probe-salt-0123456789abcdef"


async def _client(base: str, key: str, stop: float, out: dict[str, int], tier: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    while time.monotonic() < stop:
        try:
            raw = await sdk.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": f"{tier} request"}],
                max_tokens=40)
            out[tier] = out.get(tier, 0) + 1
            if raw.headers.get("x-kvgate-route") == "queued":
                out[f"{tier} queued"] = out.get(f"{tier} queued", 0) + 1
        except openai.APIStatusError as exc:
            out[f"{tier} {exc.status_code}"] = out.get(f"{tier} {exc.status_code}", 0) + 1
    await sdk.close()


def run(seconds: float, peer_lag_ms: float | None, free_clients: int = 6) -> dict[str, int]:
    with redis_server() as url, environ({
            "KVGATE_REDIS_URL": url, "KVGATE_CONFIG": "", "KVGATE_ADMIN_TOKEN": ADMIN,
            "KVGATE_SALT_SECRET": SALT}), Fleet() as fleet:
        sim = fleet.sim("m", "--time-scale", "4")
        flow: dict[str, object] = {"enabled": True, "max_inflight": 2}
        if peer_lag_ms is not None:
            flow["peer_lag_ms"] = peer_lag_ms
        config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
                  "models": {"m": {"default": "p"}}, "flow": flow,
                  "tiers": {"premium": {"flow": {"band": 0}},
                            "free": {"flow": {"band": 1}}}}
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            json.dump(config, f)  # (JSON is YAML)
        bases = []
        for _ in range(2):
            gw = free_port()
            fleet.start(["serve", "--host", "127.0.0.1", "--port", str(gw), "--config",
                         f.name, "--log-level", "warning"],
                        f"http://127.0.0.1:{gw}/readyz")
            bases.append(f"http://127.0.0.1:{gw}")
        a, b = bases
        os.unlink(f.name)
        keys = {}
        with httpx.Client(base_url=f"{a}/admin", timeout=10,
                          headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
            for tenant, tier in (("prem", "premium"), ("free", "free")):
                admin.post("/tenants", json={"id": tenant, "tier": tier})
                keys[tier] = admin.post(f"/tenants/{tenant}/keys").json()["key"]
        out: dict[str, int] = {}

        async def go() -> None:
            stop = time.monotonic() + seconds
            await asyncio.gather(
                _client(a, keys["premium"], stop, out, "premium"),
                *(_client(b, keys["free"], stop, out, "free")
                  for _ in range(free_clients)))

        asyncio.run(go())
        return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--peer-lag-ms", type=float)
    args = p.parse_args(argv)
    print(run(args.seconds, args.peer_lag_ms), flush=True)


if __name__ == "__main__":
    main()
