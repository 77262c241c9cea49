"""A redis-server that wants a password, with an ACL user that may read but not write: what an
operator's wrong `KVGATE_REDIS_URL` meets (tests of the tenancy store's refusals)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.tenancy import connect_redis
from tests.support.procs import Proc, free_port, redis_proc

__all__ = ["password_redis"]

# what the ACL user ``reader`` may do: read and subscribe, not write nor run scripts
READER_COMMANDS = ["+@read", "+subscribe", "+ping", "+hello", "+client", "+info"]


@contextmanager
def password_redis(password: str, reader_password: str) -> Iterator[int]:
    """A redis-server on a free loopback port requiring ``password``, with the ACL user
    ``reader`` (``reader_password``: `READER_COMMANDS`); yields its port, stops it after."""
    port = free_port()
    proc, _ = redis_proc(port)
    proc = Proc([*proc.cmd, "--requirepass", password], ready_port=port)
    with proc:
        async def add_reader() -> None:
            r = connect_redis(f"redis://:{password}@127.0.0.1:{port}/0")
            await r.acl_setuser("reader", enabled=True, passwords=[f"+{reader_password}"],
                                keys=["~*"], channels=["*"], commands=READER_COMMANDS)
            await r.aclose()
        asyncio.run(add_reader())
        yield port
