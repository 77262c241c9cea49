"""Follow a Service's EndpointSlices through the Kubernetes API: LIST, then WATCH, resync.

The protocol (Kubernetes API concepts, "Efficient detection of changes"): LIST returns the
items and a collection ``resourceVersion``; WATCH from that version streams one JSON event per
line (``ADDED``/``MODIFIED``/``DELETED``/``BOOKMARK``/``ERROR``). A version the server no longer
holds answers HTTP 410 Gone, or an ``ERROR`` event whose Status has code 410: then re-LIST.
We also re-LIST every ``resync_seconds`` so a missed event cannot leave a stale set for long.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from gateway.discovery.base import OnChange, WatcherBase, format_url
from gateway.discovery.config import DiscoveryConfigError, KubernetesConfig
from gateway.discovery.slices import urls_from_slices

__all__ = ["KubeApiError", "KubernetesDiscovery", "api_server_url"]

log = logging.getLogger(__name__)
_MIN_BACKOFF = 0.25


class KubeApiError(Exception):
    """The API server answered something other than what the protocol allows."""


class _Gone(Exception):
    """The resourceVersion we watch from is too old (HTTP 410): re-LIST."""


def api_server_url(config: KubernetesConfig, env: Mapping[str, str]) -> str:
    """``config.api_server``, else the in-cluster address the kubelet puts in the env."""
    if config.api_server:
        return config.api_server.rstrip("/")
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise DiscoveryConfigError(
            "discovery.kubernetes.api_server: not set and KUBERNETES_SERVICE_HOST/PORT absent"
        )
    return format_url("https", host, int(port))


class KubernetesDiscovery(WatcherBase):
    """Replica URLs = ready endpoints of ``config.service``'s EndpointSlices, on ``config.port``."""

    def __init__(
        self,
        pool: str,
        config: KubernetesConfig,
        on_change: OnChange,
        *,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(pool, on_change)
        self.config = config
        self._base = api_server_url(config, os.environ if env is None else env)
        self._namespace = config.namespace or _read_text(config.namespace_path) or "default"
        self._slices: dict[str, dict[str, Any]] = {}
        self._client: httpx.AsyncClient | None = None

    @property
    def collection_url(self) -> str:
        ns = quote(self._namespace, safe="")
        return f"{self._base}/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"

    async def _run(self) -> None:
        self._client = self._make_client()
        backoff = _MIN_BACKOFF
        while True:
            try:
                await self._list_then_watch()
                backoff = _MIN_BACKOFF
            except _Gone:
                log.info("endpointslice watch expired; re-listing", extra={"pool": self.pool})
            except (httpx.HTTPError, KubeApiError, OSError, ValueError) as exc:
                # Keep the last known set: an API outage must not empty a working pool.
                log.warning(
                    "endpointslice discovery failed: %s", type(exc).__name__,
                    extra={"pool": self.pool, "error": str(exc)[:200]},
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_seconds)

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _make_client(self) -> httpx.AsyncClient:
        verify: ssl.SSLContext | bool = True
        ca = self.config.ca_path
        if self._base.startswith("https://") and ca and Path(ca).is_file():
            verify = ssl.create_default_context(cafile=ca)
        read = float(self.config.watch_timeout_seconds) + 30.0  # the server ends it first
        return httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(10.0, read=read))

    def _headers(self) -> dict[str, str]:
        # Re-read on every request: projected service-account tokens are rotated on disk.
        token = _read_text(self.config.token_path)
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _selector(self) -> dict[str, str]:
        return {"labelSelector": f"kubernetes.io/service-name={self.config.service}"}

    async def _list_then_watch(self) -> None:
        loop = asyncio.get_running_loop()
        version = await self._list()
        deadline = loop.time() + self.config.resync_seconds
        while (remaining := deadline - loop.time()) > 0:
            try:
                async with asyncio.timeout(remaining):
                    version = await self._watch(version)
            except TimeoutError:
                return  # time for the periodic re-LIST

    async def _list(self) -> str:
        assert self._client is not None
        resp = await self._client.get(
            self.collection_url, params=self._selector(), headers=self._headers()
        )
        if resp.status_code != 200:
            raise KubeApiError(f"LIST endpointslices: HTTP {resp.status_code}")
        body = orjson.loads(resp.content)
        self._slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        self._publish_slices()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str:
        assert self._client is not None
        params = {
            **self._selector(),
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.config.watch_timeout_seconds),
        }
        async with self._client.stream(
            "GET", self.collection_url, params=params, headers=self._headers()
        ) as resp:
            if resp.status_code == 410:
                raise _Gone
            if resp.status_code != 200:
                raise KubeApiError(f"WATCH endpointslices: HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if line.strip():
                    version = self._apply(orjson.loads(line), version)
        return version

    def _apply(self, event: dict[str, Any], version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone
            raise KubeApiError(f"watch error event: code {obj.get('code')}")
        meta = obj.get("metadata") or {}
        new_version = str(meta.get("resourceVersion") or version)
        if kind == "BOOKMARK":
            return new_version
        if kind in ("ADDED", "MODIFIED"):
            self._slices[meta["name"]] = obj
        elif kind == "DELETED":
            self._slices.pop(meta.get("name", ""), None)
        else:
            raise KubeApiError(f"unknown watch event type {kind!r}")
        self._publish_slices()
        return new_version

    def _publish_slices(self) -> None:
        cfg = self.config
        self._publish(urls_from_slices(self._slices.values(), cfg.port, cfg.scheme))


def _read_text(path: str) -> str | None:
    """A small credentials file's stripped content, or None when absent (e.g. kubectl proxy)."""
    try:
        return Path(path).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None
