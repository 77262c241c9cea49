"""What flow control holds per queued request (`Ticket`) and per pool (`PoolState`)."""

from __future__ import annotations

import asyncio
import math

from gateway.errors import ShutDownWhileQueued
from gateway.policy_doc import PolicyDoc
from gateway.tenancy.resolver import Principal
from routing.flow import Entry, PoolFlow

__all__ = ["PoolState", "Ticket"]


class Ticket:
    """One queued request's handle: its future (True: moved to another pool by a policy
    change, `move`; False: released), who sent it (its key's hash: whether it is still
    valid), for which model and how much context it takes (``need``: where a policy change
    sends it, a prompt too long for a pool skipping it), when it was first queued
    (``since``: a move does not restart its wait), how many requests its pool had been sent
    when it was queued there (``sends``: whether anything went while it waited) and, once
    offered, its queue entry."""

    __slots__ = ("entry", "fut", "key_hash", "model", "need", "principal", "sends", "since",
                 "state")

    def __init__(
        self, fut: asyncio.Future[bool], principal: Principal, key_hash: str | None,
        model: str, need: int, since: float, sends: int,
    ) -> None:
        self.fut = fut
        self.principal, self.key_hash = principal, key_hash
        self.model, self.need, self.since = model, need, since
        self.sends = sends
        self.entry: Entry[Ticket] | None = None
        self.state: PoolState | None = None

    def move(self) -> None:
        """Out of its queue, to be admitted again where the policy in force sends it."""
        if self.entry is not None and self.state is not None and self.entry.queued:
            self.state.flow.remove(self.entry)
            if not self.fut.done():
                self.fut.set_result(True)

    def fail(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)

    def fire(self, reason: str) -> None:
        """Shutdown started (`gateway.drain.interrupt_waiting`; for a request queued after
        that, the grace is over: `interrupt_all`)."""
        if self.entry is not None and self.state is not None:
            self.state.flow.remove(self.entry)
        self.fail(ShutDownWhileQueued("The gateway is shutting down; the request was not sent."))


class PoolState:
    __slots__ = ("checked", "doc", "flow", "name", "owed_since", "room_since", "sends", "sent_at",
                 "timer", "transit")

    def __init__(self, name: str, flow: PoolFlow[Ticket]) -> None:
        self.name = name
        self.flow = flow
        self.checked = -math.inf  # when its queued requests' keys were last looked up
        self.transit: Ticket | None = None  # released, not yet on its replica
        self.timer: asyncio.TimerHandle | None = None
        self.doc: PolicyDoc | None = None  # the policy the shares were taken from
        self.sends = 0  # requests sent to the pool (straight, spilled or released)
        self.sent_at = -math.inf  # when the last of them was
        # since when it has had room (`_held_above`; None: it has none; from the start)
        self.room_since: float | None = -math.inf
        # since when a lower band owed its minimum share has been held (`_held_above`)
        self.owed_since: float | None = None

