"""A request's claim on a replica (`Replica.acquire`): its share of the replica's in-flight
counters, given back once by `release` (called from a ``finally`` on every path, so counters
cannot leak), and the cut that tries it elsewhere when its replica is found stalled, down,
frozen or asleep before it got anything (`Lease.on_stall`), or ends a stream that sent the
client something when its replica is found down, frozen or stalled (`Lease.on_lost`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.replicas import Replica

__all__ = ["FIRST_WAIT_DECAY", "Lease"]

# the attempt the current task made last (`Replica.acquire`): an outcome recorded from that
# task on that replica is judged by the epoch its request was sent in; one recorded anywhere
# else (a probe, another replica's attempt) counts as current
_SENT: ContextVar[Lease | None] = ContextVar("kvgate_sent_lease", default=None)
# each stream's first event weighs the replica's longest first-event wait down by this
# factor (halved in ~14 streams quicker than it): the longest recent wait
FIRST_WAIT_DECAY = 0.95


class Lease:
    """One request's claim on a replica's counters. `release` is safe to call twice."""

    __slots__ = ("_cut", "_prefill", "_released", "_whole", "answered", "engine_tokens", "epoch",
                 "replica", "scrapes", "seen", "sent_at", "since")

    def __init__(self, replica: Replica, prompt_tokens: int, stream: bool = True) -> None:
        self.replica = replica
        self.epoch = replica.epoch  # the ejections it was sent after (`Replica.record_failure`)
        self._cut: Callable[[], None] | None = None
        self._prefill = prompt_tokens
        self._whole = 0 if stream else prompt_tokens  # its part of `whole_waiting_tokens`
        self._released = False
        self.answered = False  # a first token (or a whole answer) arrived
        self.seen = replica.answers  # its progress when this request was sent (`hung`)
        self.engine_tokens = replica.engine_tokens()  # ... and its engine's, as last scraped
        self.scrapes = replica.scrapes  # the scrapes before it was sent
        # a stream's wait for its first event is its replica's evidence of how long a healthy
        # wait there can be (`BlindWatch`); a whole answer's wait includes its decode: none
        self.since = time.monotonic()  # when it was sent (`ReplicaState.oldest_wait_s`)
        self.sent_at = self.since if stream else None

    def on_stall(self, cut: Callable[[], None]) -> None:
        """Call `cut` if its replica is found stalled before this request got anything (a
        first token, a whole answer) or ended: it can be tried elsewhere."""
        if not self.answered and not self._released:
            self._cut = cut
            self.replica.cuttable.add(self)

    def on_lost(self, cut: Callable[[], None]) -> None:
        """A stream answering (after `first_token`): call `cut` when its replica is found
        down, frozen or stalled (`ReplicaHealth._cut_waiting` with ``started``), each time
        until it is released -- `cut` judges whether the stream itself went quiet."""
        if not self._released:
            self._cut = cut
            self.replica.cuttable.add(self)

    def cut(self) -> None:
        """Its replica stalled: the request is cut (once; an answering stream's `on_lost`
        is asked again at each finding until its release)."""
        cut = self._cut
        if not self.answered:
            self._uncuttable()
        if cut is not None:
            cut()

    def _uncuttable(self) -> None:
        if self._cut is not None:
            self._cut = None
            self.replica.cuttable.discard(self)

    def first_token(self) -> None:
        """The prompt is answered: it no longer waits for prefill."""
        if not self.answered and not self._released:
            self.replica.inflight_prefill -= 1
            self.replica.inflight_prefill_tokens -= self._prefill
            self.replica.whole_waiting_tokens -= self._whole
            self.replica.answers += 1
            if self.sent_at is not None:  # (decaying: one wait during an incident long
                # past must not keep the rule from judging that replica ever after)
                waited = time.monotonic() - self.sent_at
                longest = self.replica.longest_first_s * FIRST_WAIT_DECAY
                self.replica.longest_first_s = max(longest, waited)
            if self.epoch == self.replica.epoch:
                self.replica.current_waiting -= 1
        self.answered = True
        self._uncuttable()

    def release(self) -> None:
        if self._released:
            return
        replica = self.replica
        if not self.answered:  # ended unanswered: it no longer waits for prefill either
            replica.inflight_prefill -= 1
            replica.inflight_prefill_tokens -= self._prefill
            replica.whole_waiting_tokens -= self._whole
        self._released = True
        self._uncuttable()
        replica.inflight -= 1
        if self.scrapes < replica.scrapes:  # in flight at its last scrape, which counts it
            replica.ended_since_scrape += 1
        if self.epoch == replica.epoch:  # sent since its last ejection
            replica.current -= 1
            if not self.answered:
                replica.current_waiting -= 1
        if replica.watch is not None:
            replica.watch()
