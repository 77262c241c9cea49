"""Redis failures in words, and where a client points, without credentials."""

from __future__ import annotations

import socket

from redis.exceptions import AuthenticationError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.errors import StoreUnreachable
from gateway.tenancy.redis_conn import connect_redis, failure_cause, redis_address


def _raised_from(cause: BaseException) -> RedisConnectionError:
    try:
        try:
            raise cause
        except OSError:
            raise RedisConnectionError("Error connecting to 10.0.0.7:6380.")  # noqa: B904
    except RedisConnectionError as exc:
        return exc


def test_the_os_error_under_a_redis_error_is_named() -> None:
    assert failure_cause(_raised_from(ConnectionRefusedError(111, "Connect call failed"))) == (
        "connection refused")
    assert failure_cause(_raised_from(socket.gaierror(-2, "Name or service not known"))) == (
        "name or service not known")
    assert failure_cause(_raised_from(TimeoutError())) == "timed out"
    assert failure_cause(ResponseError("READONLY You can't write against a read only replica")) \
        == "server replied READONLY"
    assert failure_cause(RedisConnectionError("x")) == "ConnectionError"


def test_a_known_reply_is_named_by_its_code_as_redis_py_parses_it() -> None:
    # redis-py strips the code of the replies it maps to a class and keeps it apart (the
    # message starts with the reply's second word: "server replied command" was logged for OOM)
    oom = OutOfMemoryError("command not allowed when used memory > 'maxmemory'.",
                           status_code="OOM")
    assert failure_cause(oom) == "server replied OOM"
    readonly = ReadOnlyError("You can't write against a read only replica.",
                             status_code="READONLY")
    assert failure_cause(readonly) == "server replied READONLY"
    assert failure_cause(ResponseError("MISCONF Redis is configured to save RDB snapshots")) \
        == "server replied MISCONF"


def test_the_address_leaves_out_user_and_password() -> None:
    assert redis_address(connect_redis("redis://bob:s3cret@10.0.0.7:6380/2")) == "10.0.0.7:6380"
    assert redis_address(connect_redis("redis://localhost")) == "localhost:6379"
    assert redis_address(connect_redis("unix:///sockets/redis.sock")) == "/sockets/redis.sock"


def test_a_refusal_retrying_does_not_cure_is_named_in_the_answer() -> None:
    """OOM, READONLY, WRONGTYPE, a refused password: Redis answered, and will refuse again.
    The 503 said "did not answer; retry shortly"; it names the refusal now (no secret in
    it), while a timeout or a refused connection still says only that Redis did not answer."""
    oom = StoreUnreachable(failure_cause(OutOfMemoryError(
        "command not allowed when used memory > 'maxmemory'.", status_code="OOM")))
    assert oom.message.startswith("the tenancy store (Redis) refused the request (OOM): it is "
                                  "out of memory")
    wrong = StoreUnreachable(failure_cause(ResponseError(
        "WRONGTYPE Operation against a key holding the wrong kind of value")))
    assert "(WRONGTYPE): a key kvgate uses holds another type" in wrong.message
    auth = StoreUnreachable(failure_cause(AuthenticationError("Authentication required.")))
    assert "refused kvgate's credentials" in auth.message
    down = StoreUnreachable(failure_cause(_raised_from(ConnectionRefusedError(111, "refused"))))
    assert down.message == "the tenancy store (Redis) did not answer; retry shortly"
    assert (oom.status, down.status) == (503, 503)
