"""A large request body does not hold the gateway's event loop: other requests keep being
answered while it is prepared (in a worker thread), it gets a clean answer itself (or a clean
413), and it is routed as if it had been prepared inline."""

from __future__ import annotations

import asyncio
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from gateway.prepare import OFF_LOOP_BYTES
from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]

# ~7 MB of 200,000 short messages: the gateway's Python passes over them take a few tenths of
# a second (parse checks, prompt estimate, canonical prompt text)
MESSAGES = 200_000


def _big_body() -> bytes:
    msgs = [{"role": "user", "content": f"hello {i}"} for i in range(MESSAGES)]
    return orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 1})


def _read_answer(sock: socket.socket, buf: bytearray) -> bool:
    """Read what is there; True once a whole HTTP/1.1 answer is in."""
    chunk = sock.recv(65536)
    buf += chunk
    head, sep, rest = bytes(buf).partition(b"\r\n\r\n")
    if not chunk or not sep:
        return not chunk  # closed: stop waiting for it
    lines = head.lower().split(b"\r\n")
    if b"transfer-encoding: chunked" in lines:
        return rest.endswith(b"0\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in lines
                   if line.startswith(b"content-length:")), 0)
    return len(rest) >= length


def _gateway_with_its_replica_down() -> tuple[Proc, str]:
    """A pool whose one replica is down and stays ejected: a large body is parsed, planned and
    rewritten, then answered 503 at once (no replica's time hides the gateway's)."""
    dead = f"http://127.0.0.1:{free_port()}"
    return gateway_proc(config={
        "pools": {"p": {"served_model": "m", "replicas": [dead]}},
        "health": {"interval_s": 0.2, "eject_base_s": 600, "eject_max_s": 600},
    }, ready=False)


def test_small_request_is_answered_while_a_large_body_is_prepared() -> None:
    # nothing the large body awaits after its preparation lets the small request slip in
    gw, base = _gateway_with_its_replica_down()
    body = _big_body()
    port = int(base.rsplit(":", 1)[1])
    with gw:
        wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 503, what="replica down")
        big = socket.create_connection(("127.0.0.1", port))
        small = socket.create_connection(("127.0.0.1", port))
        try:
            big.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\n"
                        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:-1])
            time.sleep(0.5)  # the gateway has read all but the last byte
            big.sendall(body[-1:])  # the body is complete: its preparation starts now ...
            small.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")  # ... and this comes in
            order: list[str] = []
            bufs = {big: bytearray(), small: bytearray()}
            with selectors.DefaultSelector() as sel:
                sel.register(big, selectors.EVENT_READ, "big")
                sel.register(small, selectors.EVENT_READ, "small")
                deadline = time.monotonic() + 60
                while len(order) < 2 and time.monotonic() < deadline:
                    for key, _ in sel.select(timeout=1):
                        sock = key.fileobj
                        assert isinstance(sock, socket.socket)
                        if _read_answer(sock, bufs[sock]):
                            order.append(key.data)
                            sel.unregister(sock)
        finally:
            big.close()
            small.close()
        assert order == ["small", "big"], order
        head, _, answer = bytes(bufs[big]).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        assert orjson.loads(answer)["error"]["type"] == "ServiceUnavailableError"
        assert bufs[small].startswith(b"HTTP/1.1 200")


def test_body_over_the_limit_is_413_in_openai_shape() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw, base = gateway_proc(config={"pools": {"p": {"served_model": "m", "replicas": [dead]}},
                                    "server": {"max_body_bytes": 1_000_000}}, ready=False)
    with gw:
        r = httpx.post(f"{base}/v1/chat/completions", content=_big_body(),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "RequestEntityTooLargeError"
        assert "1000000 bytes" in r.json()["error"]["message"]


def test_a_large_body_is_routed_on_the_same_prefix_as_a_small_one(
    sim_factory: SimFactory,
) -> None:
    """A large body's prefix features are computed in a worker thread: they must be the ones
    the request path computes inline, or a conversation that grows past the threshold would
    lose its replica."""
    urls = [sim_factory("--time-scale", "50", "--max-model-len", "65536")[1] for _ in range(2)]
    gw, base = gateway_proc(upstreams=urls, args=["--policy", "cache_aware"])
    system = {"role": "system", "content": " ".join(f"rule {i}: be precise." for i in range(200))}
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "x" * 90}
             for i in range(1500)]

    def ask(client: httpx.Client, messages: list[dict[str, Any]]) -> tuple[str, str, int]:
        body = orjson.dumps({"model": "sim-model", "messages": messages, "max_tokens": 2})
        r = client.post("/v1/chat/completions", content=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-kvgate-replica"], r.headers["x-kvgate-route"], len(body)

    with gw, httpx.Client(base_url=base) as client:
        first, _, small = ask(client, [system, turns[0]])
        big_replica, big_route, big = ask(client, [system, *turns])
        assert small < OFF_LOOP_BYTES <= big
        assert (big_replica, big_route) == (first, "prefix-hit")
        again = ask(client, [system, *turns[:2]])  # inline again, on the chain the big one left
        assert again[:2] == (first, "prefix-hit")


def _memory_mb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split(field + ":")[1].split()[0]) // 1024


def test_concurrent_large_bodies_are_prepared_a_few_at_a_time() -> None:
    """Each 7 MB body of short messages parses into ~150 MB of objects: eight sent at once
    must not all be parsed at once (they were, by the thread pool: ~640 MB more at the peak;
    two at a time: ~250 MB)."""
    gw, base = _gateway_with_its_replica_down()
    body = _big_body()
    with gw:
        wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 503, what="replica down")
        assert gw.popen is not None
        before = _memory_mb(gw.popen.pid, "VmRSS")

        async def send_all() -> list[int]:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=8)) as c:
                answers = await asyncio.gather(*[
                    c.post(f"{base}/v1/chat/completions", content=body) for _ in range(8)])
            return [r.status_code for r in answers]

        assert asyncio.run(send_all()) == [503] * 8
        peak = _memory_mb(gw.popen.pid, "VmHWM")
        assert peak - before < 450, (before, peak)


def _post(base: str, size: int) -> httpx.Response:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * size}]})
    return httpx.post(f"{base}/v1/chat/completions", content=body, timeout=10)


def _uploads_full(resp: httpx.Response) -> bool:
    return resp.status_code == 503 and "too many request bodies" in resp.text


def test_bodies_still_arriving_are_bounded_all_together() -> None:
    """Slow uploads, each within `max_body_bytes`, held the gateway's memory without bound
    (40 of 7 MiB held: +280 MB RSS; a tenant's limits are checked only once its body is in).
    Past `server.max_pending_body_bytes` of bodies arriving a body gets a 503 with
    Retry-After; once the slow one left, bodies are taken again (nothing stays counted)."""
    dead = f"http://127.0.0.1:{free_port()}"
    gw, base = gateway_proc(config={
        "pools": {"p": {"served_model": "m", "replicas": [dead]}},
        "server": {"max_body_bytes": 1 << 20, "max_pending_body_bytes": 1 << 20},
    }, ready=False)
    with gw:
        slow = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
                     + b'{"model": "m", "messages": [{"role": "user", "content": "'
                     + b"x" * 600_000)  # and holds the rest back
        wait_for(lambda: _uploads_full(_post(base, 500_000)), 10,
                 "a body refused while the slow one arrives")
        refused_now = _post(base, 500_000)
        assert _uploads_full(refused_now) and refused_now.headers["retry-after"] == "1"
        assert refused_now.json()["error"]["type"] == "ServiceUnavailableError"
        slow.close()
        wait_for(lambda: not _uploads_full(_post(base, 500_000)), 10, "bodies taken again")
        for _ in range(3):  # the slow one's bytes, and each refused one's, were given back
            assert not _uploads_full(_post(base, 500_000))
