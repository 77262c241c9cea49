"""A bare OpenAI pass-through: the reference kvgate's proxy cost is measured against.

    python -m loadtest.bare_proxy PORT UPSTREAM [UPSTREAM ...]

aiohttp server and aiohttp client, keep-alive to every upstream, requests spread round robin,
the body forwarded as is and the answer relayed chunk by chunk (streams stay streams). No
authentication, parsing, routing, accounting, metrics or logging: what any Python proxy on
this stack has to pay at least. `bench_overhead` runs it beside kvgate, pinned to the same
core, so the ratio of the two CPU costs is measured in one run.
"""

from __future__ import annotations

import itertools
import sys

import aiohttp
from aiohttp import web

__all__ = ["main"]

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                        "host", "content-encoding"})


def make_app(upstreams: list[str]) -> web.Application:
    turn = itertools.cycle(upstreams)
    app = web.Application()

    async def start(app: web.Application) -> None:
        app["client"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await app["client"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        client: aiohttp.ClientSession = request.app["client"]
        async with client.post(next(turn) + request.path, data=body, headers=headers) as up:
            out = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/{tail:.*}", forward)
    app.router.add_get("/readyz", health)
    return app


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m loadtest.bare_proxy PORT UPSTREAM [UPSTREAM ...]",
              file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(make_app([u.rstrip("/") for u in args[1:]]), host="127.0.0.1",
                port=int(args[0]), print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
