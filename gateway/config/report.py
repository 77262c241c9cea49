"""What an operator is told about a loaded configuration beyond its validation: the effective
config with its secrets redacted (`kvgate config check`), and the pools whose discovery cannot
work where the gateway runs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gateway.config.model import KvgateConfig
from gateway.urls import shown_url

__all__ = ["discovery_problems", "redacted_dump"]


def discovery_problems(cfg: KvgateConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """Pools following Kubernetes without `api_server` where no in-cluster address is set
    (outside a cluster): `kvgate serve` refuses to start, rather than stop in its lifespan."""
    from gateway.discovery.config import KubernetesConfig  # lazy: only with discovery
    from gateway.discovery.kubernetes import api_server_url

    env = os.environ if environ is None else environ
    out = []
    for name, pool in cfg.pools.items():
        kube = (pool.discovery or {}).get("kubernetes")
        if kube is None:
            continue
        try:
            api_server_url(KubernetesConfig.model_validate(kube), env)
        except ValueError as exc:
            out.append(f"pools.{name}.{exc} (outside a cluster, set it: e.g. "
                       "http://127.0.0.1:8001 with `kubectl proxy`)")
    return out


def redacted_dump(cfg: KvgateConfig) -> dict[str, Any]:
    """The effective config as plain data, with secrets replaced by a marker."""
    data = cfg.model_dump(mode="json", exclude={"redis_url", "admin_token", "salt_secret"})
    for name in ("redis_url", "admin_token", "salt_secret"):
        data[name] = "<set, redacted>" if getattr(cfg, name) is not None else None
    for pool in data.get("pools", {}).values():
        pool["replicas"] = [shown_url(url) for url in pool.get("replicas") or []]
        env_name = pool.get("api_key_env")
        if env_name:
            pool["api_key"] = "<set, redacted>" if os.environ.get(env_name) else "<not set>"
    return data
