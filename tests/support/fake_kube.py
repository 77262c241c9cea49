"""A small fake of the Kubernetes API's EndpointSlice list and watch (served over real HTTP on
127.0.0.1 by the `kube` fixture in tests/conftest.py), shared by the discovery tests."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

SERVICE = "vllm-fp8"
NAMESPACE = "llm"
TOKEN = "test-token-not-a-secret"
COLLECTION = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def endpoint(ip: str, ready: bool | None = True) -> dict[str, Any]:
    conditions = {} if ready is None else {"ready": ready}
    return {"addresses": [ip], "conditions": conditions}


def eps(name: str, *endpoints: dict[str, Any], port_name: str = "http") -> dict[str, Any]:
    """An EndpointSlice as the API serves it (discovery.k8s.io/v1)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": SERVICE},
        },
        "addressType": "IPv4",
        "endpoints": list(endpoints),
        "ports": [
            {"name": port_name, "port": 8000, "protocol": "TCP"},
            {"name": "metrics", "port": 9000, "protocol": "TCP"},
        ],
    }


class FakeKube:
    """LIST and chunked WATCH of EndpointSlices, with 410 Gone for expired versions."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 100
        self.oldest_watchable = 0
        self.lists = 0
        self.unauthorized: asyncio.Queue[None] = asyncio.Queue()
        self._streams: list[asyncio.Queue[bytes | None]] = []
        self._connected = asyncio.Event()

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = orjson.loads(orjson.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def put(self, obj: dict[str, Any], *, event: str | None = "MODIFIED") -> None:
        """Store a slice; send `event` to open watches (None: a change no watch sees)."""
        obj = self._bump(obj)
        self.slices[obj["metadata"]["name"]] = obj
        if event:
            self._send({"type": event, "object": obj})

    def delete(self, name: str) -> None:
        obj = self._bump(self.slices.pop(name))
        self._send({"type": "DELETED", "object": obj})

    def expire(self, *, as_event: bool) -> None:
        """Forget every version so far: open watches end (with an ERROR event, or silently)."""
        self.oldest_watchable = self.version + 1
        if as_event:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                      "reason": "Expired", "code": 410, "message": "too old resource version"}
            self._send({"type": "ERROR", "object": status})
        self.close_streams()

    def close_streams(self) -> None:
        for queue in self._streams:
            queue.put_nowait(None)

    async def watching(self) -> None:
        await self._connected.wait()
        self._connected.clear()

    def _send(self, event: dict[str, Any]) -> None:
        for queue in self._streams:
            queue.put_nowait(orjson.dumps(event) + b"\n")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.unauthorized.put_nowait(None)
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if request.query.get("labelSelector") != f"kubernetes.io/service-name={SERVICE}":
            return web.json_response({"kind": "Status", "code": 400}, status=400)
        if request.query.get("watch") == "true":
            return await self._watch(request)
        self.lists += 1
        return web.json_response({
            "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.version)},
            "items": list(self.slices.values()),
        })

    async def _watch(self, request: web.Request) -> web.StreamResponse:
        if int(request.query["resourceVersion"]) < self.oldest_watchable:
            return web.json_response({"kind": "Status", "code": 410, "reason": "Expired"},
                                     status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._streams.append(queue)
        self._connected.set()
        try:
            while (line := await queue.get()) is not None:
                await resp.write(line)
        finally:
            self._streams.remove(queue)
        await resp.write_eof()
        return resp
