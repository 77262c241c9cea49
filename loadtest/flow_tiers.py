"""Tier priority behind two gateways sharing state: free tenants' clients on gateway B keep the
pool saturated, one premium client on gateway A sends request after request. How many
requests each tier had served, and the premium requests' waits in the queue (their
``x-kvgate-route: queued``), with flow control bounding one simulated replica.

``--mixed``: both tiers through both gateways instead, as many premium clients as free ones
(premium always backlogged): whether the free band still gets its minimum share (the floor,
``fairness.default_min_share`` 0.1) with other gateways live. ``--json PATH`` adds the run,
under ``--label``, to the file.

``python -m loadtest.flow_tiers [--seconds S] [--peer-lag-ms MS] [--mixed] [--json P --label L]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

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


def run(
    seconds: float, peer_lag_ms: float | None, free_clients: int = 6, mixed: bool = False,
) -> dict[str, int]:
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
            if mixed:  # every tier through both gateways, premium always backlogged
                await asyncio.gather(*(
                    _client(bases[i % 2], keys[tier], stop, out, tier)
                    for tier in ("premium", "free") for i in range(free_clients)))
                return
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
    p.add_argument("--mixed", action="store_true", help="both tiers through both gateways")
    p.add_argument("--json", help="add the run to this JSON file, under --label")
    p.add_argument("--label", default="run")
    args = p.parse_args(argv)
    out = run(args.seconds, args.peer_lag_ms, mixed=args.mixed)
    print(out, flush=True)
    if args.json:
        runs = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        runs[args.label] = {"seconds": args.seconds, "peer_lag_ms": args.peer_lag_ms,
                            "mixed": args.mixed, **out}
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
