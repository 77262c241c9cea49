"""A refusal only a client on another host meets (a gateway pod, Redis in another): Redis in
protected mode answers every command with DENIED. Tests reach Redis on loopback only, where
protected mode lets every command through, so the reply is built as redis-py raises it, with
the server's text. It was "server replied DENIED", which did not say what to change."""

from __future__ import annotations

from redis.exceptions import ResponseError

from gateway.errors import StoreUnreachable
from gateway.tenancy.redis_conn import cause_label, failure_cause

# Redis 7.0's reply (src/networking.c), as redis-py raises it
DENIED = ("DENIED Redis is running in protected mode because protected mode is enabled and no "
          "password is set for the default user. In this mode connections are only accepted "
          "from the loopback interface.")


def test_protected_mode_says_what_to_change() -> None:
    cause = failure_cause(ResponseError(DENIED))
    assert cause == ("server replied DENIED: Redis runs in protected mode (no password set: it "
                     "takes connections from its own loopback only); give it a password "
                     "(requirepass) and put it in KVGATE_REDIS_URL")
    assert cause_label(cause) == "protected"  # was "other", though the log named it
    assert "protected mode" not in StoreUnreachable(cause).message  # the log's, not a client's
