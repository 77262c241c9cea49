"""EndpointSlice objects → replica URLs (pure; no I/O).

Field meanings are from the discovery.k8s.io/v1 API reference: an endpoint's
``conditions.ready`` left unset means "unknown", which consumers should treat as ready, and
``conditions.terminating`` true means the pod is going away, whatever ``ready`` says;
``addresses`` of one endpoint are fungible, so the first one is used; a slice's ``ports``
name the Service port they back (``name`` is empty for a single unnamed port).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gateway.discovery.base import format_url

__all__ = ["slice_port", "slice_urls", "urls_from_slices"]


def slice_port(obj: Mapping[str, Any], port: str | int) -> int | None:
    """The port number to use in this slice, or None if it does not carry that port."""
    if isinstance(port, int):
        return port
    ports = obj.get("ports") or []
    for entry in ports:
        if (entry.get("name") or "") == port and isinstance(entry.get("port"), int):
            return int(entry["port"])
    if len(ports) == 1 and not ports[0].get("name") and isinstance(ports[0].get("port"), int):
        return int(ports[0]["port"])  # a Service with one unnamed port
    return None


def _is_ready(endpoint: Mapping[str, Any]) -> bool:
    conditions = endpoint.get("conditions") or {}
    # a terminating pod takes no new request even where `ready` says true: a Service with
    # `publishNotReadyAddresses` (a headless one of a StatefulSet) reports every endpoint
    # ready, terminating ones too, and a rolling restart's old pod kept drawing requests
    # until its process was gone (the requests it took then failed)
    if conditions.get("terminating") is True:
        return False
    ready = conditions.get("ready")
    return ready is None or ready is True


def slice_urls(obj: Mapping[str, Any], port: str | int, scheme: str) -> set[str]:
    """URLs of the ready endpoints of one EndpointSlice."""
    number = slice_port(obj, port)
    if number is None:
        return set()
    urls: set[str] = set()
    for endpoint in obj.get("endpoints") or []:
        addresses = endpoint.get("addresses") or []
        if addresses and _is_ready(endpoint):
            urls.add(format_url(scheme, str(addresses[0]), number))
    return urls


def urls_from_slices(
    slices: Iterable[Mapping[str, Any]], port: str | int, scheme: str
) -> frozenset[str]:
    """The union over all slices of a Service (a Service may have many). A dual-stack
    Service has slices of both address families, each pod in one of each: only the IPv4
    ones count then, or every pod was two replicas (its load and prefix affinity split in
    two, its capacity counted twice; vLLM listens on IPv4 unless told otherwise)."""
    slices = list(slices)
    families = {obj.get("addressType") for obj in slices}
    both = {"IPv4", "IPv6"} <= families
    urls: set[str] = set()
    for obj in slices:
        if not (both and obj.get("addressType") == "IPv6"):
            urls |= slice_urls(obj, port, scheme)
    return frozenset(urls)
