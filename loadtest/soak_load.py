"""The mixed load `bench_soak` keeps on a gateway: good clients and bad ones, all on 127.0.0.1.

Each `Mix` coroutine loops until `stop` is set: streamed and whole chat completions (some
left after their first chunk), Responses API create + retrieve, requests a gateway must refuse
(unknown keys, unknown and ever-new model names, bad JSON, ever-new paths), clients that
leave mid-upload, never read their stream, or trickle their headers (slowloris), idle
keep-alive connections, bursts past flow control's queue with some clients leaving while
queued, and admin API changes (policy patches, tenants created and deleted).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx
import orjson

__all__ = ["Mix"]

PREFIXES = [f"You are assistant number {i}. " + "Context line. " * 60 for i in range(8)]


def _chat(stream: bool, max_tokens: int = 24, model: str = "soak") -> dict[str, object]:
    text = random.choice(PREFIXES) + f"Question {random.randrange(10**6)}?"
    return {"model": model, "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}]}


@dataclass
class Mix:
    base: str
    port: int
    keys: list[str]
    admin_token: str
    api: str = ""  # where the admin API is (the picker's HTTP port), if not at `base`
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    seen: Counter[str] = field(default_factory=Counter)
    # seconds of each whole chat answered 200 since `window` was last called
    latencies: list[float] = field(default_factory=list)

    def window(self) -> dict[str, float]:
        """p50/p99 (ms) of the whole chats answered since the last call."""
        got, self.latencies = sorted(self.latencies), []
        if not got:
            return {}
        return {"p50_ms": round(got[len(got) // 2] * 1000),
                "p99_ms": round(got[min(len(got) - 1, int(len(got) * 0.99))] * 1000)}

    def _auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or random.choice(self.keys)}"}

    async def _guard(self, what: str, coro: object) -> None:
        try:
            await coro  # type: ignore[misc]
        except (TimeoutError, httpx.HTTPError, OSError) as exc:
            self.seen[f"{what}:{type(exc).__name__}"] += 1

    async def chat(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            await self._guard("chat", self._one_chat(client))

    async def _one_chat(self, client: httpx.AsyncClient) -> None:
        stream = random.random() < 0.7
        body = _chat(stream)
        if not stream:
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json=body, headers=self._auth())
            self.seen[f"chat:{r.status_code}"] += 1
            if r.status_code == 200:
                self.latencies.append(time.monotonic() - t0)
            return
        leave = random.random() < 0.15
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=self._auth()) as r:
            async for _ in r.aiter_raw():
                if leave:
                    break  # the client goes away mid-stream: the connection is closed
            self.seen[f"stream:{r.status_code}{':left' if leave else ''}"] += 1

    async def responses(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            await self._guard("responses", self._one_response(client))

    async def _one_response(self, client: httpx.AsyncClient) -> None:
        key = random.choice(self.keys)
        r = await client.post("/v1/responses", headers=self._auth(key),
                              json={"model": "soak", "input": "hello", "max_output_tokens": 8})
        self.seen[f"responses:{r.status_code}"] += 1
        if r.status_code == 200:
            got = await client.get(f"/v1/responses/{r.json()['id']}", headers=self._auth(key))
            self.seen[f"retrieve:{got.status_code}"] += 1

    async def refused(self, client: httpx.AsyncClient) -> None:
        """What a gateway must refuse, each value new (nothing kept per value may grow)."""
        while not self.stop.is_set():
            await self._guard("refused", self._one_refused(client))
            await asyncio.sleep(0.01)

    async def _one_refused(self, client: httpx.AsyncClient) -> None:
        u = uuid.uuid4().hex
        kind = random.randrange(5)
        if kind == 0:
            r = await client.post("/v1/chat/completions", json=_chat(False),
                                  headers=self._auth(f"sk-unknown-{u}"))
        elif kind == 1:
            r = await client.post("/v1/chat/completions", json=_chat(False, model=f"m-{u}"),
                                  headers=self._auth())
        elif kind == 2:
            r = await client.post("/v1/chat/completions", content=b'{"model": "soak", ',
                                  headers={**self._auth(), "x-request-id": u})
        elif kind == 3:
            r = await client.post(f"/v1/x-{u}", json={}, headers=self._auth())
        else:
            r = await client.get(f"/v1/responses/resp_{u}", headers=self._auth())
        self.seen[f"refused{kind}:{r.status_code}"] += 1

    async def _raw(self, head: bytes, body: bytes, hold_s: float, read: bool) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(head + body)
            await writer.drain()
            if read:
                await asyncio.wait_for(reader.read(65536), hold_s)
            else:
                await asyncio.sleep(hold_s)
        finally:
            writer.transport.abort()

    def _post_head(self, length: int, stream_key: str | None = None) -> bytes:
        return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % ((stream_key or self.keys[0]).encode(), length))

    async def rude(self) -> None:
        """Clients leaving mid-upload, never reading a stream, trickling their headers."""
        while not self.stop.is_set():
            kind = random.randrange(3)
            if kind == 0:  # declares 10 kB, sends 100 bytes, leaves
                coro = self._raw(self._post_head(10_000), b'{"model": "soak", ' + b" " * 80,
                                 random.uniform(0.0, 0.5), read=False)
            elif kind == 1:  # a long stream it never reads, then leaves
                body = orjson.dumps(_chat(True, max_tokens=2000))
                coro = self._raw(self._post_head(len(body), random.choice(self.keys)), body,
                                 random.uniform(1.0, 4.0), read=False)
            else:
                coro = self._slowloris()
            await self._guard(f"rude{kind}", coro)

    async def _slowloris(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            for b in b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 40:
                writer.write(bytes([b]))
                await writer.drain()
                await asyncio.sleep(0.1)
                if reader.at_eof() or self.stop.is_set():
                    break
        finally:
            writer.transport.abort()

    async def idle(self, n: int) -> None:
        """`n` keep-alive connections, each used once, then held idle until the end."""
        conns = []
        for _ in range(n):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
                await writer.drain()
                await asyncio.wait_for(reader.read(4096), 10)
                conns.append(writer)
            except (TimeoutError, OSError):
                self.seen["idle:failed"] += 1
        self.seen["idle:open"] = len(conns)
        await self.stop.wait()
        for w in conns:
            w.transport.abort()

    async def bursts(self, client: httpx.AsyncClient, size: int, every_s: float) -> None:
        """`size` streams at once, past flow control's queue; a third leave after 0.2 s."""
        while not self.stop.is_set():
            tasks = [asyncio.create_task(self._guard("burst", self._one_chat(client)))
                     for _ in range(size)]
            await asyncio.sleep(0.2)
            for t in tasks[: size // 3]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.seen["burst:done"] += 1
            await self._sleep(every_s)

    async def _sleep(self, s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), s)

    async def admin(self, every_s: float) -> None:
        """Policy patches and tenant churn through the admin API."""
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        async with httpx.AsyncClient(base_url=f"{self.api or self.base}/admin", headers=headers,
                                     timeout=30) as a:
            n = 0
            while not self.stop.is_set():
                n += 1
                rpm = 100_000 + n
                await self._guard("admin", self._admin_once(a, n, rpm))
                await self._sleep(every_s)

    async def _admin_once(self, a: httpx.AsyncClient, n: int, rpm: int) -> None:
        r = await a.patch("/policy", json={"tiers": {"free": {"limits": {"rpm": rpm}}}})
        self.seen[f"admin-policy:{r.status_code}"] += 1
        tid = f"churn-{n}"
        r = await a.post("/tenants", json={"id": tid, "tier": "free"})
        k = await a.post(f"/tenants/{tid}/keys")
        if k.status_code == 201:
            async with httpx.AsyncClient(base_url=self.base, timeout=30) as c:
                await c.post("/v1/chat/completions", json=_chat(False),
                             headers=self._auth(k.json()["key"]))
        d = await a.delete(f"/tenants/{tid}")
        self.seen[f"admin-tenant:{r.status_code}/{d.status_code}"] += 1
