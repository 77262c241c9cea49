"""One pool's flow control as the gateway and the offline replay both run it: the saturation
rule in front of the queue. Pure (time and views passed in).

Per request: `admit` -- straight through when nothing is queued and the pool is not saturated
(work-conserving: no wait, no reordering); otherwise the caller `offer`s it to the queue.
Whenever capacity may have freed (a request answered or finished, a fresh scrape, a tick),
the caller asks `release` for the next request to send, one at a time, until it says None.
Every request sent (admitted, released, or spilled here: `sent`) is the pool's until the
caller says it is `done`.

**The share cap** (``FlowConfig.share_cap``): a tenant holding more than ``share_cap`` times
its weighted fair share of the pool's in-flight tokens (`routing.flow.share`) is passed over
by the other tenants of its band when `release` gives the band its turn (the cap reorders
tenants, never bands). A *hog* -- over its share of the in-flight tokens and of the tokens sent
to the pool lately (the dispatch rate's window), so not a tenant that merely holds one long
prompt -- goes only to a replica with *spare room*: room under the saturation rule with its
bounds scaled by ``1 - share_headroom``, and left within that rule's KV knee and prefill bound
with the hog's request in. Where there is none it waits even when nobody else in its band
does: `admit` queues it, `release` gives the turn to the next band, and once released it is
routed among those replicas only (`with_room`). The headroom is what the other tenants'
requests find on every replica when they arrive: little of the hog's prefill ahead of them,
KV for their prompts. A tenant alone in the pool is never over its share; with
``share_headroom`` 0 the cap is work-conserving (an over-share tenant waits only while
another tenant of its band does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from routing.flow.bands import Entry
from routing.flow.config import DEFAULT_MIN_SHARE, FlowConfig, Saturation
from routing.flow.queue import FlowQueue, Offer
from routing.flow.saturation import (
    full_reason,
    never_spare,
    pool_saturated,
    with_room,
    with_spare,
)
from routing.flow.share import Holdings, SendRates
from routing.peers import ReplicaLoad
from routing.types import ReplicaView

__all__ = ["MAX_REQUEST_COST", "PoolFlow", "Standing", "request_cost"]

T = TypeVar("T")
_NO_PEERS: Mapping[str, ReplicaLoad] = {}


# the most output a request is charged: beyond any model's context (vLLM refuses more), and
# small enough that sums of charges stay exact in a float (a client's `max_tokens` of 2**63
# added to a tenant's holdings absorbed its other requests' tokens, and took them back with it)
MAX_OUTPUT_TOKENS = 1 << 24
# the most a request is charged in all: n sequences (up to 2**64 - 1 as a client may send it,
# before vLLM refuses it) or a batch of prompts times even a bounded output would lose the
# same exactness; 2**40 leaves thousands of such charges inside a float's 2**53
MAX_REQUEST_COST = 1 << 40


def request_cost(
    prompt_tokens: int, max_tokens: int | None, expected_output: int,
    context: int | None = None, sequences: int = 1, prompts: int = 1,
) -> float:
    """What fair sharing charges a request: its prompt plus its expected output (``max_tokens``
    when the client set it, else the configured expectation; at most `MAX_OUTPUT_TOKENS`, and
    at most what fits beside the prompt in the model's ``context`` (``max_model_len``) when
    it is known: a replica can produce no more, and refuses a request that asks for more),
    once per output sequence (OpenAI's ``n``: the prompt is computed once, each of the n
    sequences may generate up to ``max_tokens``). A completions batch of ``prompts`` prompts
    (``prompt_tokens`` their sum) is checked against the context one prompt at a time, so
    the cap is what fits beside an average prompt, not beside the whole batch."""
    prompt = max(0, prompt_tokens)
    out = max_tokens if max_tokens is not None and max_tokens >= 0 else expected_output
    out = min(out, MAX_OUTPUT_TOKENS)
    if context is not None:
        out = min(out, max(0, context - -(-prompt // max(1, prompts))))
    return float(min(prompt + out * max(1, sequences), MAX_REQUEST_COST))


@dataclass(frozen=True, slots=True)
class Standing:
    """A tenant against the share cap, for explain (`PoolFlow.standing`)."""

    inflight_share: float  # its part of the pool's in-flight tokens (0..1)
    recent_share: float  # its part of the tokens sent to the pool lately (the rate window)
    # weight / sum of weights (the tenants holding work or waiting); None: it cannot be over
    # its share (it holds nothing in the pool, or nobody else holds or waits)
    fair_share: float | None
    over_share: bool  # over share_cap x fair_share of the in-flight tokens: passed over
    hog: bool  # over it in the recent tokens too
    # a hog's request goes only to these replicas (spare room for it); empty: it waits.
    # None: not held to spare room (not a hog, or share_headroom 0)
    spare: tuple[str, ...] | None


class PoolFlow(Generic[T]):
    def __init__(
        self, config: FlowConfig, min_share: Mapping[int, float] | None = None,
        default_min_share: float = DEFAULT_MIN_SHARE,
    ) -> None:
        self.config = config
        self.queue: FlowQueue[T] = FlowQueue(
            config.max_queue, min_share, default_min_share, config.rate_window_s)
        self.holdings = Holdings()
        self.rates = SendRates(config.rate_window_s)
        self._cap = config.share_cap or 1.0
        self._capped = config.share_cap is not None
        self.set_saturation(config.saturation)
        self.hog_holds = 0  # queued requests passed over for lack of spare room, each once

    def set_saturation(self, rule: Saturation) -> None:
        """The saturation rule from now on (a policy change of the pool's in-flight bound);
        what is queued stays queued, released by the new rule."""
        if rule is not self.config.saturation:
            self.config = replace(self.config, saturation=rule)
        self._near = rule.scaled(1.0 - self.config.share_headroom)
        # an over-share tenant waits for spare room only with a headroom (at 0 the cap only
        # reorders the queue: work-conserving)
        self._spares = self._capped and self._near is not rule

    def __len__(self) -> int:
        """Requests queued."""
        return len(self.queue)

    def saturated(
        self, views: Sequence[ReplicaView], peers: Mapping[str, ReplicaLoad] = _NO_PEERS
    ) -> bool:
        return pool_saturated(views, self.config.saturation, peers)

    def has_room(self, view: ReplicaView, peers: Mapping[str, ReplicaLoad] = _NO_PEERS) -> bool:
        """Whether ``view``'s replica takes one more request under the saturation rule (a
        retry goes only to such a fallback, `FlowLedger.retry_to`)."""
        return full_reason(view, peers.get(view.id), self.config.saturation) is None

    def with_room(
        self, views: Sequence[ReplicaView], peers: Mapping[str, ReplicaLoad] = _NO_PEERS,
        tokens: int = 0, tenant: str = "", cost: float = 0.0, now: float = 0.0,
    ) -> list[ReplicaView]:
        """The views to route a ``tokens``-token prompt from: the replicas without room for
        it marked unhealthy (`saturation.with_room`). A request of ``tenant`` (``cost``
        tokens, `sent` at ``now``) that was a hog's goes only to a replica with spare room
        (`_spare`), when there is one."""
        if self._spares and self._hog(tenant, self.queue.waiting(), now, cost):
            spare = self._spare(views, peers, cost)
            if spare is not None:
                return spare
        return with_room(views, self.config.saturation, peers, tokens)

    def _hog(self, tenant: str, waiting: Mapping[str, float], now: float, less: float = 0.0
             ) -> bool:
        """Over its share both of the pool's in-flight tokens and of the tokens sent to it
        lately (the dispatch rate's window): a tenant taking more than its share, not one that
        happens to hold a long prompt (`routing.flow.share`). ``less``: as before one of its
        requests of that many tokens was sent."""
        h = self.holdings
        due = h.due(tenant, waiting, self._cap, less)
        if due is None or h.tokens(tenant) - less <= due * (h.total - less):
            return False
        sent = less / self.rates.window_s  # that request's part of the rates
        return self.rates.rate(tenant, now) - sent > due * (self.queue.rate(now) - sent)

    def _spare(
        self, views: Sequence[ReplicaView], peers: Mapping[str, ReplicaLoad], cost: float
    ) -> list[ReplicaView] | None:
        """Where a hog's request of ``cost`` tokens may go: the replicas with room under the
        headroom's rule (`saturation.with_spare`) that it leaves within that rule's KV knee
        and prefill bound; a request too large to be left within the knee even on an idle
        replica, to one with nothing in flight (`never_spare`).
        None: nowhere, it waits. A pool without a healthy replica holds
        no hog (nor is it saturated): waiting would not bring a replica back, routing answers
        503 at once; ``views`` as they are."""
        if not _any_healthy(views):
            return list(views)
        spare = with_spare(views, self._near, peers, cost)
        if spare is None:  # too large for spare room even on an idle replica
            return never_spare(views, self._near, peers, cost)
        return spare

    def admit(
        self, views: Sequence[ReplicaView], cost: float, now: float,
        peers: Mapping[str, ReplicaLoad] = _NO_PEERS, tenant: str = "", weight: float = 1.0,
    ) -> bool:
        """True: send it now (counted as `sent`). False: it must be offered to the queue."""
        if self.queue or pool_saturated(views, self.config.saturation, peers):
            return False
        if (self._spares and self._hog(tenant, {}, now)
                and self._spare(views, peers, cost) is None):
            return False  # over its share, no replica with spare room: the headroom is others'
        self.sent(tenant, cost, now, weight)
        return True

    def sent(self, tenant: str, cost: float, now: float, weight: float = 1.0) -> None:
        """A request of ``tenant`` went to the pool without waiting in its queue."""
        self.queue.note_dispatch(cost, now)
        self.holdings.add(tenant, cost, weight)
        self.rates.add(tenant, cost, now)

    def done(self, tenant: str, cost: float) -> None:
        """A request sent to the pool finished (answered, failed, or abandoned)."""
        self.holdings.remove(tenant, cost)

    def refund(
        self, tenant: str, tokens: float, now: float, entry: Entry[T] | None = None
    ) -> None:
        """A request sent was charged ``tokens`` it did not cost (the replica refused it
        before any output): its tenant's recent sends, the pool's rate and, when it waited
        in the queue (``entry``), its tenant's place there give them back. Its holding goes
        at `done`, as any request's."""
        self.rates.refund(tenant, tokens, now)
        self.queue.refund(entry, tokens, now)

    def over_share(self, tenant: str) -> bool:
        """Whether ``tenant`` holds more than its share of the pool's in-flight tokens."""
        cap = self.config.share_cap
        return cap is not None and self.holdings.over(tenant, self.queue.waiting(), cap)

    def standing(
        self, tenant: str, views: Sequence[ReplicaView], cost: float, now: float,
        peers: Mapping[str, ReplicaLoad] = _NO_PEERS,
    ) -> Standing:
        """Where ``tenant`` stands against the share cap for its next request of ``cost``
        tokens, by the rules `admit`, `release` and `with_room` apply (nothing changes)."""
        h, waiting = self.holdings, self.queue.waiting()
        pool_rate = self.queue.rate(now)
        hog = self._capped and self._hog(tenant, waiting, now)
        spare = None
        if hog and self._spares and _any_healthy(views):
            room = self._spare(views, peers, cost)
            spare = tuple(v.id for v in room if v.healthy) if room is not None else ()
        return Standing(
            inflight_share=h.tokens(tenant) / h.total if h.total > 0 else 0.0,
            recent_share=self.rates.rate(tenant, now) / pool_rate if pool_rate > 0 else 0.0,
            fair_share=h.due(tenant, waiting),
            over_share=self.over_share(tenant), hog=hog, spare=spare)

    def offer(
        self, handle: T, *, tenant: str, band: int, cost: float, now: float,
        max_wait_s: float, weight: float = 1.0, tier: str = "",
    ) -> Offer[T]:
        return self.queue.offer(handle, tenant=tenant, band=band, cost=cost, now=now,
                                max_wait_s=max_wait_s, weight=weight, tier=tier)

    def release(
        self, views: Sequence[ReplicaView], now: float,
        peers: Mapping[str, ReplicaLoad] = _NO_PEERS, upto: int | None = None,
    ) -> Entry[T] | None:
        """The next queued request to send now, or None (nothing queued, no room, or only
        tenants over their share wait and no replica has spare room for them); only from
        the bands up to level ``upto`` when given (`FlowQueue.pop`)."""
        queue = self.queue
        if not queue or pool_saturated(views, self.config.saturation, peers):
            return None
        waiting = queue.waiting()
        over = self.holdings.over_share(waiting, self._cap) if self._capped else set()

        def hold(e: Entry[T]) -> bool:  # a hog waits for a replica with spare room
            if (not self._hog(e.tenant, waiting, now)
                    or self._spare(views, peers, e.cost) is not None):
                return False
            if not e.held:
                e.held = True
                self.hog_holds += 1
            return True

        entry = queue.pop(now, over, hold if self._spares else None, upto)
        if entry is not None:
            self._took(entry, now)
        return entry

    def pop(self, now: float) -> Entry[T] | None:
        """The next queued request in the queue's order, room or not."""
        entry = self.queue.pop(now)
        if entry is not None:
            self._took(entry, now)
        return entry

    def _took(self, entry: Entry[T], now: float) -> None:
        self.holdings.add(entry.tenant, entry.cost, entry.weight)
        self.rates.add(entry.tenant, entry.cost, now)

    def expire(self, now: float) -> list[Entry[T]]:
        return self.queue.expire(now)

    def remove(self, entry: Entry[T]) -> bool:
        return self.queue.remove(entry)


def _any_healthy(views: Sequence[ReplicaView]) -> bool:
    return any(v.healthy for v in views)
