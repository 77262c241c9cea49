"""What the log says while the tenancy store (Redis) does not answer: one clear line at the
first failure (address and cause, never the URL's credentials; "cannot reach Redis" for the
network, "refused by Redis" for a reply refusing kvgate: credentials, an ACL, a full Redis),
then at most one line a minute with a count, and one line when it answers again. A cause of
another kind during an outage (Redis restarted with a password: refused connections, then
WRONGPASS) gets its own line at once, at most once a minute per kind. A gateway
started with a wrong ``KVGATE_REDIS_URL`` thus says so at once instead of repeating a bare
retry line. A Redis that flaps (stalls of a second, a proxy dropping connections) says so at
most once a minute per cause too: an outage that begins within a minute of a line for its
cause is counted, not logged, and so is its end, unless it lasts until a summary line names
it (measured: a Redis paused 0.7 s every second wrote a warning and an info line every 2 s
per component).

Other users of Redis (the shared routing state, lease renewal) say the same through their own
logger, each line prefixed with what is affected (``subject``).

A Redis reached over TLS (``tls`` true, a ``rediss://`` URL) that times out before it ever
answered is most likely a port without TLS, which waits for a command and never answers the
handshake; one reached without TLS (``tls`` false) that resets the connection before it ever
answered, a port that serves only TLS: the line says so (it read "timed out", "connection
reset by peer"). Not told (None), it says nothing of TLS."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gateway.tenancy.redis_conn import cause_label, refusal_code

__all__ = ["Reachability", "ends_with_a_connection"]

# `cause_label`s a connection set up and answering ends
_CONNECTION_CAUSES = frozenset({"unreachable", "timeout", "auth", "loading", "notredis"})

log = logging.getLogger(__name__)


class Reachability:
    def __init__(
        self, address: str, *, retry_every_s: float, summary_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic, subject: str = "",
        logger: logging.Logger = log, tls: bool | None = None,
    ) -> None:
        self.address = address
        self._tls = tls  # None: not told (no hint)
        self._answered = False  # ever
        self._prefix = f"{subject}: " if subject else ""
        self._log = logger
        self._retry_every_s = retry_every_s
        self._summary_every_s = summary_every_s
        self._clock = clock
        self._down_since: float | None = None
        self._failures = 0  # since the store last answered
        self._unsaid = 0  # failures not yet in a log line
        self._said_at = float("-inf")  # the last warning line
        self._said: dict[str, float] = {}  # cause -> its last warning line (a minute's)
        self._kinds: dict[str, float] = {}  # cause_label -> its last warning line
        self._quiet = False  # this outage is not in the log (Redis flaps)
        self._flaps = 0  # outages not in the log since the last line
        self.cause: str | None = None  # the current outage's latest cause; None: it answers

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def failed(self, cause: str) -> None:
        now = self._clock()
        self._failures += 1
        if not self._answered and self._tls is not None:
            cause += _tls_hint(cause, self._tls)
        before, self.cause = self.cause, cause
        if self._down_since is None:
            self._down_since, self._unsaid = now, 0
            self._quiet = now - self._said.get(cause, float("-inf")) < self._summary_every_s
            if self._quiet:
                self._flaps += 1
                return
            flaps = (f"; {self._flaps} short outages in the last {now - self._said_at:.0f} s "
                     "not logged" if self._flaps else "")
            self._said = {c: t for c, t in self._said.items()
                          if now - t < self._summary_every_s}
            self._said[cause] = self._said_at = self._kinds[cause_label(cause)] = now
            self._flaps = 0
            self._log.warning("%s%s Redis at %s (%s); retrying every %g s%s", self._prefix,
                              _trouble(cause), self.address, cause, self._retry_every_s, flaps,
                              extra={"redis": self.address, "cause": cause})
            return
        self._unsaid += 1
        if before is not None and self._new_kind(before, cause, now):
            return
        if now - self._said_at >= self._summary_every_s:
            self._quiet = False  # named now: its end will be too
            self._log.warning("%sstill %s Redis at %s (%s): %d failed attempts in the last "
                              "%.0f s, down for %.0f s", self._prefix, _trouble(cause),
                              self.address, cause, self._unsaid, now - self._said_at,
                              now - self._down_since,
                              extra={"redis": self.address, "cause": cause})
            self._said_at, self._unsaid = now, 0

    def _new_kind(self, before: str, cause: str, now: float) -> bool:
        """Says at once that an outage's cause became another kind (Redis restarted with a
        password: "connection refused", then WRONGPASS), at most once a minute per kind: the
        refusal, what an operator must act on, was only in the next minute's summary line,
        under the first line's "cannot reach"."""
        kind = cause_label(cause)
        if kind == cause_label(before) or now - self._kinds.get(kind, float("-inf")) < \
                self._summary_every_s:
            return False
        self._kinds[kind] = self._said[cause] = self._said_at = now
        self._quiet = False  # named now: its end will be too
        self._log.warning("%snow %s Redis at %s (%s), after %d failed attempts in %.0f s; "
                          "retrying every %g s", self._prefix, _trouble(cause), self.address,
                          cause, self._failures - 1, now - (self._down_since or now),
                          self._retry_every_s, extra={"redis": self.address, "cause": cause})
        self._unsaid = 0
        return True

    def connected(self) -> None:
        """A connection was set up and answered one command (a subscription): the end of an
        outage that no connection could get past (Redis not reached, a timeout, refused
        credentials, loading), not of a refusal of some commands (NOPERM, OOM, WRONGTYPE,
        READONLY, ...): the commands refused say when that ends (`answered`). An ACL user
        that may SUBSCRIBE but not read kvgate's keys logged "answers again" after each
        refusal, while the store was never loaded."""
        if self.cause is None or ends_with_a_connection(self.cause):
            self.answered()

    def answered(self) -> None:
        self.cause = None
        self._answered = True
        if self._down_since is None:
            return
        if self._quiet:  # a flap, counted for the next line
            self._down_since, self._failures, self._unsaid = None, 0, 0
            return
        self._log.info("%sRedis at %s answers again (down for %.0f s, %d failed attempts)",
                       self._prefix, self.address, self._clock() - self._down_since,
                       self._failures, extra={"redis": self.address})
        self._down_since, self._failures, self._unsaid = None, 0, 0


def ends_with_a_connection(cause: str) -> bool:
    """Whether a connection set up and answering ends a failure of `cause` (Redis not
    reached, a timeout, refused credentials, loading), or only the commands it refused
    succeeding do (NOPERM, OOM, WRONGTYPE, READONLY, ...)."""
    return cause_label(cause) in _CONNECTION_CAUSES


def _trouble(cause: str) -> str:
    """What the log says of a failure: a refusal is no network trouble (it read "cannot reach
    Redis" for a wrong password, and sent operators to the network)."""
    return "cannot reach" if refusal_code(cause) is None else "refused by"


def _tls_hint(cause: str, tls: bool) -> str:
    """What to add to the cause of a failure before Redis ever answered that a URL's scheme
    not matching the port's TLS explains."""
    if tls and cause == "timed out":
        return (" in the TLS handshake? KVGATE_REDIS_URL is rediss://, and a Redis port "
                "without TLS never answers it: use redis:// or the TLS port")
    if not tls and cause == "connection reset by peer":
        return (" (a Redis port that serves only TLS resets plain connections: "
                "rediss:// in KVGATE_REDIS_URL?)")
    return ""
