"""One way to open Redis for tenancy: short timeouts, no hidden retries, errors mapped.

Redis sits on the request path only for rate-limit admission, so a dead Redis must fail fast
(the caller then falls back) instead of stalling requests behind redis-py's retry loop.

A client holds at most `max_connections` connections; a call past them waits for one, as
long as a call may take (`timeout_s`). redis-py's own pool refused the call past its bound
at once ("Too many connections": a burst of a limited tenant's admissions put the gateway
on per-process fallback limits), and an unbounded one opens a connection per admission in
flight, past Redis's `maxclients` or the process's file descriptors.
"""

from __future__ import annotations

import errno
import os
import re
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool, ConnectionPool, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, MaxClientsReachedError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.errors import StoreUnreachable

__all__ = [
    "CAUSE_LABELS", "MAX_CONNECTIONS", "cause_label", "connect_redis", "failure_cause",
    "redis_address", "redis_tls", "redis_unavailable", "refusal_code",
]

MAX_CONNECTIONS = 64  # per client (`tenancy.redis_max_connections`)
# what redis-py's blocking pool raises when no connection came free in time
_POOL_WAIT = "No connection available."
# what redis-py raises when the server closed a connection it held (Redis restarted or shut
# down with a command in flight, `CLIENT KILL`, Redis's idle `timeout`): no OS error under it,
# so it was named by its class, "cannot reach Redis at ... (ConnectionError)"
_CLOSED = "Connection closed by server."

# What `kvgate_redis_down_cause` and `kvgate_sync_down_cause` name (`cause_label`): a fixed
# set, so a label never carries free text (an address, a key) and the series stay bounded.
# `dbindex` (the URL's /N past `databases`) and `protected` (protected mode's DENIED) were
# `other`, though the log and /readyz named them: appended, so a cause's index (the doctor's
# history) keeps its meaning
# `notredis`: the address answers, but not in Redis's protocol (another service's port)
CAUSE_LABELS = ("unreachable", "timeout", "auth", "noperm", "oom", "wrongtype", "loading",
                "readonly", "misconf", "other", "dbindex", "protected", "notredis")
_BY_CODE = {"WRONGPASS": "auth", "NOAUTH": "auth", "AuthenticationError": "auth",
            "NOPERM": "noperm", "OOM": "oom", "WRONGTYPE": "wrongtype", "LOADING": "loading",
            "BusyLoadingError": "loading", "READONLY": "readonly", "MISCONF": "misconf",
            "DENIED": "protected"}
# Redis answers a command its ACL forbids inside a script with ERR, not NOPERM: "The user
# executing the script can't run this command..." (7.0), "ACL failure in script: ..." (7.2)
_SCRIPT_ACL = ("The user executing the script can't", "ACL failure in script")
# NOPERM's texts: "this user has no permissions to run the 'set' command" (Redis 7; "User bob
# has no permissions ..." from 7.2), "... to access one of the keys used as arguments"
_NOPERM_COMMAND = re.compile(r"no permissions to run the '([A-Za-z|_-]{1,64})' command")
_NOPERM_ACCESS = re.compile(r"no permissions to access one of the (keys|channels) ")
# what Redis answers an unauthenticated client's command of more than 10 arguments (an
# XADD of the shared routing state) before it closes the connection: "server replied ERR"
# every other retry, where the others said NOAUTH
_UNAUTHENTICATED = "Protocol error: unauthenticated"
# AUTH with a password where the default user has none (Redis 6+): the shared routing
# state's RESP2 connections are refused, "server replied ERR" and nothing more, while the
# tenancy store's (HELLO 3 ... AUTH, which Redis takes) answered
_NO_PASSWORD = "called without any password configured"
_DB_RANGE = "DB index is out of range"  # SELECT (the URL's /N) past `databases`
# a server whose answer is not Redis's protocol (an HTTP server, SSH, a database's port):
# it read "cannot reach Redis at ... (InvalidResponse)", a class name that sent operators to
# the network; the answer itself is not shown (another service's bytes, into the log)
_NOT_REDIS = ("the server there is not Redis (its answer is not Redis's protocol: another "
              "service at that port?)")


def connect_redis(
    url: str, *, timeout_s: float = 0.5, max_connections: int = MAX_CONNECTIONS,
) -> aioredis.Redis:
    """A client (lazy: nothing connects until the first command) of at most
    `max_connections` connections; a call waits up to `timeout_s` for one of them."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
    )
    return aioredis.Redis.from_pool(pool)


def redis_address(client: aioredis.Redis) -> str:
    """Where a client connects, for logs: ``host:port`` or a socket path (never the user name
    or the password its URL may carry)."""
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return str(kw["path"])
    host = str(kw.get("host", "localhost"))
    return f"[{host}]:{kw.get('port', 6379)}" if ":" in host else f"{host}:{kw.get('port', 6379)}"


def redis_tls(pool: ConnectionPool) -> bool:
    """Whether a pool's connections use TLS (a ``rediss://`` URL)."""
    return issubclass(pool.connection_class, SSLConnection)


def failure_cause(exc: BaseException) -> str:
    """A Redis failure in a few words: the OS error under it (``connection refused``, ``name
    or service not known``, ``timed out``), a connection the server closed, a TLS
    handshake's refusal (``TLS certificate refused: self-signed certificate``), a server
    reply's first word (``READONLY``, ``WRONGPASS``: replies never echo a password;
    ``NOPERM`` for a script's ACL refusal), else the exception's class name."""
    seen: BaseException | None = exc
    while seen is not None:
        # before OSError: an SSLError's errno is OpenSSL's code (1 read as "operation not
        # permitted")
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"TLS certificate refused: {seen.verify_message}"
        if isinstance(seen, ssl.SSLError):
            return f"TLS handshake failed ({seen.reason or type(seen).__name__})"
        if isinstance(seen, RedisConnectionError) and str(seen) == _POOL_WAIT:
            # its cause is a TimeoutError: said so, and what it waited for
            return "timed out waiting for a free connection (tenancy.redis_max_connections)"
        if isinstance(seen, RedisConnectionError) and str(seen) == _CLOSED:
            return "connection closed by the server"
        # redis-py's own TimeoutError is no builtin one; raised with nothing under it (seen
        # on a stopped Redis: "concurrency lease renewal: cannot reach Redis at ...
        # (TimeoutError)", labelled unreachable)
        if isinstance(seen, (TimeoutError, RedisTimeoutError)):
            return "timed out"
        if isinstance(seen, InvalidResponse):
            return _NOT_REDIS
        if isinstance(seen, MaxClientsReachedError):  # an ERR reply, named by its text
            return "server replied ERR max number of clients reached (Redis's maxclients)"
        if isinstance(seen, OSError) and seen.errno is not None:
            if seen.errno in errno.errorcode:
                return os.strerror(seen.errno).lower()
            if seen.strerror:  # getaddrinfo's own codes (negative)
                return seen.strerror.lower()
        seen = seen.__cause__ or seen.__context__
    # redis-py keeps a known reply's code apart (OOM, READONLY, ...: the message then starts
    # with the reply's second word), also on its connection errors (WRONGPASS, LOADING)
    code = getattr(exc, "status_code", None)
    if isinstance(exc, ResponseError):
        words = str(exc).split()
        code = code or (words[0] if words else None)
        if code == "ERR" and str(exc).removeprefix("ERR ").startswith(_SCRIPT_ACL):
            code = "NOPERM"  # an ACL refusal all the same
        if code == "ERR" and str(exc).startswith(_UNAUTHENTICATED):
            code = "NOAUTH"  # a password missing all the same
    if code:
        return f"server replied {code}{_what_is_wrong(code, str(exc))}"
    return type(exc).__name__


def _what_is_wrong(code: str, message: str) -> str:
    """What a refusal of the connection's set-up or of a command means for the URL an operator
    wrote (none for the others): it read "server replied WRONGPASS" and /readyz "store
    unreachable", which sent them to the network. Replies never echo a password; a NOPERM
    names the command Redis refused (redis-py keeps the reply's text after its code)."""
    if code in ("WRONGPASS", "AuthenticationError"):
        return (": authentication failed (the user name or password in KVGATE_REDIS_URL is "
                "wrong, or the ACL user is disabled)")
    if code == "NOAUTH":
        return ": authentication required (Redis has a password; KVGATE_REDIS_URL gives none)"
    if code == "NOPERM":
        if (found := _NOPERM_COMMAND.search(message)) is not None:
            return f": the ACL user of KVGATE_REDIS_URL may not run {found[1].upper()}"
        if (found := _NOPERM_ACCESS.search(message)) is not None:
            return f": the ACL user of KVGATE_REDIS_URL may not use those {found[1]}"
        return ": the ACL user of KVGATE_REDIS_URL lacks a permission kvgate needs"
    if code == "DENIED":  # only a client from another host meets it
        return (": Redis runs in protected mode (no password set: it takes connections from "
                "its own loopback only); give it a password (requirepass) and put it in "
                "KVGATE_REDIS_URL")
    if code == "ERR" and _NO_PASSWORD in message:
        return (": KVGATE_REDIS_URL gives a password, and this Redis has none for its default "
                "user (no requirepass): remove the password from the URL, or set requirepass "
                "on Redis")
    if code == "ERR" and message.startswith(_DB_RANGE):
        return (f": {_DB_RANGE} (the database number at the end of KVGATE_REDIS_URL is not "
                "below the server's `databases`, 16 by default)")
    return ""


def refusal_code(cause: str) -> str | None:
    """The reply's code of a `failure_cause` that is a server's refusal (``WRONGPASS``,
    ``NOPERM``, ``OOM``), None for the others (Redis not reached, a timeout)."""
    if not cause.startswith("server replied "):
        return None
    return cause.removeprefix("server replied ").split(":", 1)[0].split(" ", 1)[0]


def cause_label(cause: str) -> str:
    """A `failure_cause` (perhaps with words after it: the keys of a WRONGTYPE) as one of
    `CAUSE_LABELS`: a refusal by its code, a timeout, else ``unreachable`` (an OS error, a
    closed connection)."""
    if cause.startswith("timed out"):
        return "timeout"
    if cause == _NOT_REDIS:
        return "notredis"
    code = refusal_code(cause)
    if code is None:
        return "unreachable"
    if code == "ERR" and f": {_DB_RANGE}" in cause:
        return "dbindex"
    return _BY_CODE.get(code, "other")


@contextmanager
def redis_unavailable() -> Iterator[None]:
    """Map every Redis failure to `StoreUnreachable`, a `BackendUnavailable` (without the URL,
    which may hold a password, and without chaining the original exception into logs):
    connection errors and timeouts, but also server replies such as READONLY after a failover
    or MISCONF, which must degrade the same way (last known state, per-process limits), never
    answer a 500."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise StoreUnreachable(failure_cause(exc)) from None
