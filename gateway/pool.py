"""Pools at run time: replicas, their transport, the served model name and the public names.

`Pools` is built from the config inside the app's lifespan (the transports need a running
event loop) and closed there. It answers "which pool serves this public model?".
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from gateway.config import KvgateConfig
from gateway.replicas import HealthPolicy, Replica, RetryBudget
from gateway.transport import Transport

__all__ = ["Pool", "Pools"]


class Pool:
    __slots__ = ("budget", "by_id", "headers", "name", "replicas", "served_model", "transport")

    def __init__(
        self, name: str, served_model: str | None, replicas: list[Replica],
        transport: Transport, api_key: str | None, budget: RetryBudget,
    ) -> None:
        self.name = name
        self.served_model = served_model
        self.replicas = replicas
        self.by_id = {r.id: r for r in replicas}
        self.transport = transport
        self.budget = budget
        # sent with every upstream request: vLLM's --api-key, never the client's credentials
        self.headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"


class Pools:
    """All pools of one gateway and the public-name → pool map (default tier)."""

    def __init__(self, cfg: KvgateConfig) -> None:
        self._cfg = cfg
        policy = HealthPolicy(
            cfg.health.failure_threshold, cfg.health.eject_base_s, cfg.health.eject_max_s
        )
        self.by_name: dict[str, Pool] = {}
        for name, pc in cfg.pools.items():
            replicas = [Replica(name, url, policy) for url in pc.replicas]
            transport = Transport(
                max_connections=cfg.upstream.max_connections,
                connect_timeout_s=cfg.upstream.connect_timeout_s,
            )
            api_key = os.environ.get(pc.api_key_env) if pc.api_key_env else None
            budget = RetryBudget(cfg.upstream.retry_budget_ratio, cfg.upstream.retry_budget_min)
            self.by_name[name] = Pool(name, pc.served_model, replicas, transport, api_key, budget)
        self.public: dict[str, Pool] = {}
        self.refresh_public()

    def refresh_public(self) -> None:
        """Recompute public names (after a pool learned its served model name)."""
        if self._cfg.models:
            mapped = self._cfg.public_models()
            self.public = {model: self.by_name[pool] for model, pool in mapped.items()}
        else:
            self.public = {p.served_model: p for p in self.by_name.values() if p.served_model}

    def replicas(self) -> Iterator[Replica]:
        for pool in self.by_name.values():
            yield from pool.replicas

    def ready(self, now: float) -> bool:
        """Every pool knows its served model and has at least one usable replica."""
        return all(
            p.served_model and any(r.available(now) for r in p.replicas)
            for p in self.by_name.values()
        )

    async def close(self) -> None:
        for pool in self.by_name.values():
            await pool.transport.close()
