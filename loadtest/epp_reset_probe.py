"""grpcio's native memory per ext_proc stream the peer resets (grpc/grpc issue 43360), measured
two ways, side by side:

    python -m loadtest.epp_reset_probe bare [N]           # a bare grpcio aio server, no kvgate
    python -m loadtest.epp_reset_probe envoy [N] [401|404]  # kvgate epp behind a real Envoy

``bare``: a stream-stream handler reading as `gateway.epp.server` reads (a task of its own)
answers one message, and its client cancels the call once the answer is in, as Envoy resets
an ext_proc stream after an immediate response. Two handlers: ``return`` (answer, return:
the status goes out, often on a call already cancelled) and ``wait`` (answer, then wait for
the peer to end the stream). Printed: the server's C heap in use (glibc ``mallinfo2``) before
and after N calls. ``envoy``: N requests refused at their headers (an unknown key's 401, or an
unknown path's 404) through Envoy to `kvgate epp`; printed: the picker's RSS before and after.
Only 127.0.0.1 is used.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import sys
import time
from collections.abc import AsyncIterator

import grpc
import httpx

__all__ = ["main"]

WARM = 500  # calls before the first count: imports, caches and arenas are no leak


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info: _Mallinfo2 = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


async def _read(requests: AsyncIterator[bytes], inbox: asyncio.Queue[bytes | None]) -> None:
    try:
        async for msg in requests:
            inbox.put_nowait(msg)
    finally:
        inbox.put_nowait(None)


def _handler(wait: bool) -> object:
    async def process(requests: AsyncIterator[bytes], _: object) -> AsyncIterator[bytes]:
        inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        reader = asyncio.create_task(_read(requests, inbox))
        try:
            await inbox.get()
            yield b"answer"
            if wait:  # until the peer ends the stream (gRPC cancels this on a reset)
                async with asyncio.timeout(30):
                    while await inbox.get() is not None:
                        pass
        finally:
            reader.cancel()
    return process


async def _heap_rpc(_: bytes, __: object) -> bytes:
    return str(_heap()).encode()


def _server(wait: bool, ports: multiprocessing.Queue[int]) -> None:
    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.P", {
            "S": grpc.stream_stream_rpc_method_handler(_handler(wait)),
            "H": grpc.unary_unary_rpc_method_handler(_heap_rpc)}),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(serve())


async def _calls(port: int, n: int) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream, heap = channel.stream_stream("/probe.P/S"), channel.unary_unary("/probe.P/H")

        async def one() -> None:
            call = stream()
            await call.write(b"headers")
            await call.read()
            call.cancel()  # as Envoy resets the stream once it has the immediate response

        async def many(count: int) -> None:
            for _ in range(0, count, 50):
                await asyncio.gather(*(one() for _ in range(50)))

        await many(WARM)
        before = int(await heap(b""))
        await many(n)
        await asyncio.sleep(1)  # the last cancellations reach the server
        return before, int(await heap(b""))


def bare(n: int) -> None:
    for name, wait in (("return", False), ("wait", True)):
        ports: multiprocessing.Queue[int] = multiprocessing.Queue()
        proc = multiprocessing.Process(target=_server, args=(wait, ports))
        proc.start()
        try:
            before, after = asyncio.run(_calls(ports.get(timeout=30), n))
        finally:
            proc.terminate()
        print(f"bare grpcio, handler {name!r}: {n} calls, C heap {before / 2**20:.2f} -> "
              f"{after / 2**20:.2f} MiB, {(after - before) / n:.0f} B per call")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def _refused(base: str, n: int, kind: str) -> dict[int, int]:
    codes: dict[int, int] = {}
    gate = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> None:
            async with gate:
                headers = {"authorization": "Bearer not-a-key"}
                if kind == "401":
                    resp = await client.post(f"{base}/v1/chat/completions", headers=headers,
                                             json={"model": "m", "messages": []})
                else:
                    resp = await client.get(f"{base}/v1/nothing-{i}", headers=headers)
                codes[resp.status_code] = codes.get(resp.status_code, 0) + 1
        await asyncio.gather(*(one(i) for i in range(n)))
    return codes


def envoy(n: int, kind: str) -> None:
    from tests.support.epp import envoy_proc, epp_proc  # (the test harness's processes)
    from tests.support.procs import sim_proc

    sim, url = sim_proc(None, model="m")
    with sim:
        epp = epp_proc(config={"pools": {"p": {"served_model": "m", "replicas": [url]}}},
                       auth=True, env={"KVGATE_SALT_SECRET": "probe-salt-secret-0123456789"})
        with epp:
            proxy, base = envoy_proc(epp.picker)
            with proxy:
                assert epp.popen is not None
                asyncio.run(_refused(base, WARM, kind))
                time.sleep(1)
                before = _rss_mib(epp.popen.pid)
                codes = asyncio.run(_refused(base, n, kind))
                time.sleep(2)
                after = _rss_mib(epp.popen.pid)
    print(f"kvgate epp behind Envoy, {n} requests refused ({codes}): picker RSS "
          f"{before:.1f} -> {after:.1f} MiB, {(after - before) * 2**20 / n:.0f} B per request")


USAGE = "usage: python -m loadtest.epp_reset_probe bare|envoy [N] [401|404]"


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):  # as every benchmark answers it (docs/benchmarks.md)
        print(USAGE)
        return
    mode = argv[0] if argv else ""
    n = int(argv[1]) if len(argv) > 1 else 10_000
    if mode == "bare":
        bare(n)
    elif mode == "envoy":
        envoy(n, argv[2] if len(argv) > 2 else "401")
    else:
        raise SystemExit(USAGE)


if __name__ == "__main__":
    main(sys.argv[1:])
