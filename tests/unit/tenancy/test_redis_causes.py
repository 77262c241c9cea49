"""Why Redis fails, as one of a few labels: each refusal provoked on a real redis-server and
read through kvgate's client (`connect_redis`), as the gateway meets it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Iterator

import pytest
from redis._parsers.base import _RESPBase
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import StoreUnreachable
from gateway.tenancy.reachability import Reachability
from gateway.tenancy.redis_conn import CAUSE_LABELS, cause_label, connect_redis, failure_cause
from tests.support.procs import Proc, free_port, redis_proc

SCRIPT_HSET = "return redis.call('HSET', KEYS[1], 'f', 'v')"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str]]:
    """A primary and its read-only replica."""
    primary_port, port = free_port(), free_port()
    primary, url = redis_proc(primary_port)
    replica = Proc([*primary.cmd, "--replicaof", "127.0.0.1", str(primary_port)],
                   ready_port=port)
    replica.cmd[replica.cmd.index("--port") + 1] = str(port)
    with primary, replica:
        yield url, f"redis://127.0.0.1:{port}/0"


async def _label(call: Awaitable[object]) -> tuple[str, str]:
    """(failure_cause, its label) of a call that must fail."""
    try:
        await call
    except Exception as exc:
        cause = failure_cause(exc)
        return cause, cause_label(cause)
    raise AssertionError("the call succeeded")


async def test_refusals_of_a_real_redis_are_named_by_a_bounded_label(
    servers: tuple[str, str],
) -> None:
    url, replica_url = servers
    r = connect_redis(url)
    host_port = url.removeprefix("redis://").removesuffix("/0")
    try:
        await r.set("kvgate:routes", "x")
        assert (await _label(r.xadd("kvgate:routes", {"a": "b"})))[1] == "wrongtype"
        await r.acl_setuser("bob", enabled=True, passwords=["+pw"], keys=["~*"],
                            commands=["+@all", "-hset"])
        bob = connect_redis(f"redis://bob:pw@{host_port}/0")
        assert await _label(bob.hset("h", "f", "v")) == (
            "server replied NOPERM: the ACL user of KVGATE_REDIS_URL may not run HSET", "noperm")
        # inside a script Redis answers ERR, not NOPERM: it was "server replied ERR", and the
        # 503 said Redis "did not answer; retry shortly"
        script = await _label(bob.eval(SCRIPT_HSET, 1, "h"))
        assert script == ("server replied NOPERM: the ACL user of KVGATE_REDIS_URL lacks a "
                          "permission kvgate needs", "noperm")
        assert "(NOPERM)" in StoreUnreachable(script[0]).message
        wrong = connect_redis(f"redis://bob:nope@{host_port}/0")
        assert (await _label(wrong.get("x")))[1] == "auth"
        read_only = connect_redis(replica_url)
        assert await _label(read_only.set("k", "v")) == ("server replied READONLY", "readonly")
        assert (await _label(read_only.eval(SCRIPT_HSET, 1, "h")))[1] == "readonly"
        await r.config_set("maxmemory-policy", "noeviction")
        await r.config_set("maxmemory", "1")
        try:
            assert await _label(r.set("k", "v")) == ("server replied OOM", "oom")
            assert (await _label(r.eval(SCRIPT_HSET, 1, "h")))[1] == "oom"
            assert (await _label(r.xadd("kvgate:stream", {"a": "b"})))[1] == "oom"
        finally:
            await r.config_set("maxmemory", "0")
        await r.config_set("requirepass", "pw2")
        try:
            nobody = connect_redis(url)
            assert (await _label(nobody.get("x")))[1] == "auth"
        finally:
            await connect_redis(f"redis://:pw2@{host_port}/0").config_set("requirepass", "")
        for client in (bob, wrong, read_only, nobody):
            await client.aclose()
    finally:
        await r.aclose()


async def test_a_redis_that_does_not_answer_is_unreachable_or_a_timeout() -> None:
    assert (await _label(connect_redis(f"redis://127.0.0.1:{free_port()}/0").get("x")))[1] \
        == "unreachable"
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        port = silent.getsockname()[1]
        client = connect_redis(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
        assert await _label(client.get("x")) == ("timed out", "timeout")
        await client.aclose()


async def test_a_connection_the_server_closed_is_named_so() -> None:
    """A connection Redis closed with a command in flight (here `CLIENT KILL` of a client
    blocked in BLPOP; a restart, or a shutdown, alike): the cause said "ConnectionError",
    the class's name."""
    proc, url = redis_proc()
    with proc:
        # the BLPOP must still block when the kill comes: its own timeout (and the socket's)
        # far above what a loaded machine takes to see it blocked (3 s was not: it returned
        # empty first, and the kill found an idle connection)
        client = connect_redis(url, timeout_s=120.0, max_connections=1)
        killer = connect_redis(url, timeout_s=10.0)
        try:
            await client.client_setname("victim")
            blocked = asyncio.ensure_future(_label(client.blpop(["nothing"], timeout=60)))
            await asyncio.wait_for(_blocked_in_blpop(killer, "victim"), 30)
            assert await killer.client_kill_filter(_type="normal", skipme=True) >= 1
            assert await blocked == ("connection closed by the server", "unreachable")
            assert await client.get("x") is None  # a new connection: it answers again
        finally:
            await client.aclose()
            await killer.aclose()


async def test_a_server_that_is_not_redis_is_named_so() -> None:
    """Another service at the URL's port (a web server here): redis-py's InvalidResponse was
    named by its class and labelled ``unreachable``."""
    with socket.socket() as web:
        web.bind(("127.0.0.1", 0))
        web.listen(4)
        client = connect_redis(f"redis://127.0.0.1:{web.getsockname()[1]}/0", timeout_s=5.0)

        async def answer() -> None:
            conn, _ = await asyncio.get_running_loop().sock_accept(web)
            with conn:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                await asyncio.sleep(1)

        web.setblocking(False)
        server = asyncio.ensure_future(answer())
        cause, label = await _label(client.get("x"))
        await server
        await client.aclose()
    assert label == "notredis" and "is not Redis" in cause and "HTTP" not in cause


async def _blocked_in_blpop(killer: Redis, name: str) -> None:
    """Until Redis lists the client ``name`` as running BLPOP (blocked in it): polled, as
    Redis sends no event for it."""
    while True:
        if any(c.get("name") == name and c.get("cmd") == "blpop"
               for c in await killer.client_list()):
            return
        await asyncio.sleep(0.01)


def _parsed(reply: str) -> Exception:
    """What redis-py's parser makes of an error reply (the class the client raises)."""
    exc: Exception = _RESPBase.parse_error(reply)  # type: ignore[no-untyped-call]
    return exc


def test_loading_and_other_replies_as_redis_py_parses_them() -> None:
    """LOADING (a restart reading a large dataset) is not provoked here: its real reply,
    parsed by redis-py as the client does, is a connection error (BusyLoadingError)."""
    loading = _parsed("LOADING Redis is loading the dataset in memory")
    assert cause_label(failure_cause(loading)) == "loading"
    misconf = _parsed("MISCONF Redis is configured to save RDB snapshots")
    assert cause_label(failure_cause(misconf)) == "misconf"
    busy = _parsed("BUSY Redis is busy running a script")
    assert cause_label(failure_cause(busy)) == "other"
    assert cause_label("server replied WRONGTYPE: kvgate:tenants is a string, not a hash") \
        == "wrongtype"
    assert cause_label("connection refused") == cause_label("ConnectionError") == "unreachable"
    # redis-py's TimeoutError with nothing under it (no socket error): a timeout all the same
    assert failure_cause(RedisTimeoutError("Timeout reading from 127.0.0.1:6379")) == "timed out"
    assert set(map(cause_label, ("timed out", "server replied OOM"))) <= set(CAUSE_LABELS)


def test_reachability_keeps_the_cause_of_the_current_outage_only() -> None:
    reach = Reachability("127.0.0.1:6379", retry_every_s=1.0)
    assert reach.cause is None
    reach.failed("connection refused")
    reach.failed("server replied LOADING")
    assert reach.cause == "server replied LOADING"
    reach.answered()
    assert reach.cause is None
