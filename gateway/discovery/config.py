"""Typed discovery settings, parsed from a pool's ``discovery`` mapping.

A pool's config carries ``discovery: {kubernetes: {...}}`` or ``discovery: {dns: {...}}``
(see ``gateway.policy_doc.PoolConfig.discovery``); exactly one mode per pool. Errors name the field.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

__all__ = [
    "SA_DIR",
    "DiscoveryConfigError",
    "DnsConfig",
    "KubernetesConfig",
    "parse_discovery",
]

# Where the kubelet mounts a pod's service-account credentials (Kubernetes docs,
# "Accessing the Kubernetes API from a Pod").
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

# strict, as the policy document holding them (`gateway.policy_doc`): "5" is refused
Seconds = Annotated[float, Strict(), Field(gt=0)]


class DiscoveryConfigError(ValueError):
    """A pool's ``discovery`` mapping is invalid; the message names the field."""


class KubernetesConfig(BaseModel):
    """Follow the EndpointSlices of one Service through the Kubernetes API."""

    model_config = ConfigDict(extra="forbid")
    service: str
    namespace: str | None = None  # None: the pod's own namespace (service-account file)
    port: str | int = "http"  # EndpointSlice port name, or a fixed port number
    scheme: Literal["http", "https"] = "http"  # scheme of the replica URLs produced
    api_server: str | None = None  # None: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token_path: str = f"{SA_DIR}/token"
    ca_path: str | None = f"{SA_DIR}/ca.crt"  # None: the system trust store
    namespace_path: str = f"{SA_DIR}/namespace"
    resync_seconds: Seconds = 300.0  # full re-LIST even when the watch is healthy
    watch_timeout_seconds: Annotated[int, Strict(), Field(gt=0)] = 240  # server-side watch timeout
    backoff_max_seconds: Seconds = 30.0


class DnsConfig(BaseModel):
    """Resolve a (headless) Service name periodically; every address is one replica."""

    model_config = ConfigDict(extra="forbid")
    name: str  # e.g. vllm-fp8.llm.svc.cluster.local
    port: Annotated[int, Strict(), Field(gt=0, lt=65536)] = 8000
    scheme: Literal["http", "https"] = "http"
    interval_seconds: Seconds = 5.0


def parse_discovery(raw: dict[str, dict[str, object]]) -> KubernetesConfig | DnsConfig:
    """The one mode named in ``raw``, validated (``DiscoveryConfigError`` otherwise)."""
    if len(raw) != 1:
        raise DiscoveryConfigError(
            f"discovery: name exactly one mode ('kubernetes' or 'dns'), got {sorted(raw)}"
        )
    mode, body = next(iter(raw.items()))
    model: type[KubernetesConfig] | type[DnsConfig]
    if mode == "kubernetes":
        model = KubernetesConfig
    elif mode == "dns":
        model = DnsConfig
    else:
        raise DiscoveryConfigError(f"discovery: unknown mode {mode!r} (kubernetes or dns)")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # a misspelt field is the cause of the "Field required" beside it: name it first
        errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(first["loc"][-1]), list(model.model_fields),
                                              n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise DiscoveryConfigError(f"discovery.{mode}.{where}: unknown field{hint}") from None
        raise DiscoveryConfigError(f"discovery.{mode}.{where}: {first['msg']}") from None
