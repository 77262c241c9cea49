"""A pool's in-flight bound raised at run time: two gateways sharing state (one Redis) in front
of one simulated replica, flow control bounding it at ``flow.max_inflight: 1`` (an operator's
bound below the replica's real seat count), clients sending back to back through both. Half
way, ``PATCH /admin/policy {"pools": {"p": {"max_inflight": N}}}`` through gateway A. Requests
served in each half, per gateway, and the PATCH's status (a 400 where the bound is not policy).

``python -m loadtest.flow_bound [--seconds S] [--clients N] [--raise-to N] [--json P --label L]``
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

__all__ = ["main", "run"]

ADMIN = "flow-bound-probe-admin-token-0123456789"
SALT = "flow-bound-probe-salt-0123456789abcdef"


async def _client(base: str, key: str, half: float, stop: float, out: dict[str, int],
                  name: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    while time.monotonic() < stop:
        phase = "before" if time.monotonic() < half else "after"
        try:
            await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "a request"}], max_tokens=40)
            key_ = f"{name} {phase}"
        except openai.APIStatusError as exc:
            key_ = f"{name} {phase} {exc.status_code}"
        out[key_] = out.get(key_, 0) + 1
    await sdk.close()


def _gateways(fleet: Fleet, sim: str, n: int) -> list[str]:
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"m": {"default": "p"}},
              "tiers": {"free": {"flow": {"max_wait_s": 60}}},
              "flow": {"enabled": True, "max_inflight": 1}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config, f)  # (JSON is YAML)
    bases = []
    for _ in range(n):
        port = free_port()
        fleet.start(["serve", "--host", "127.0.0.1", "--port", str(port), "--config", f.name,
                     "--log-level", "warning"], f"http://127.0.0.1:{port}/readyz")
        bases.append(f"http://127.0.0.1:{port}")
    os.unlink(f.name)
    return bases


def run(seconds: float, clients: int, raise_to: int) -> dict[str, int]:
    with redis_server() as url, environ({
            "KVGATE_REDIS_URL": url, "KVGATE_CONFIG": "", "KVGATE_ADMIN_TOKEN": ADMIN,
            "KVGATE_SALT_SECRET": SALT}), Fleet() as fleet:
        sim = fleet.sim("m", "--time-scale", "4")
        bases = _gateways(fleet, sim, 2)
        with httpx.Client(base_url=f"{bases[0]}/admin", timeout=10,
                          headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
            admin.post("/tenants", json={"id": "t", "tier": "free"})
            key = admin.post("/tenants/t/keys").json()["key"]
            out: dict[str, int] = {}

            async def go() -> None:
                start = time.monotonic()
                half, stop = start + seconds / 2, start + seconds
                tasks = [asyncio.ensure_future(_client(bases[i % 2], key, half, stop, out,
                                                       "AB"[i % 2])) for i in range(clients)]
                await asyncio.sleep(seconds / 2)
                resp = await asyncio.to_thread(
                    admin.patch, "/policy", json={"pools": {"p": {"max_inflight": raise_to}}})
                out[f"patch {resp.status_code}"] = 1
                await asyncio.gather(*tasks)

            asyncio.run(go())
        return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--raise-to", type=int, default=4)
    p.add_argument("--json", help="add the run to this JSON file, under --label")
    p.add_argument("--label", default="run")
    args = p.parse_args(argv)
    out = run(args.seconds, args.clients, args.raise_to)
    print(out, flush=True)
    if args.json:
        runs = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        runs[args.label] = {"seconds": args.seconds, "clients": args.clients,
                            "raise_to": args.raise_to, **out}
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
