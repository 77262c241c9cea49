"""How fast a pool's admission queue drains (`FlowQueue`): the tokens dispatched per second,
an exponentially weighted rate over a window, and the same rate over the current span of
dispatches only, which a shed request's Retry-After is estimated from
(`FlowQueue.retry_after`). Pure: every call gets the time."""

from __future__ import annotations

import math

__all__ = ["DispatchPace"]

# the shortest span the drain rate is taken over: what goes out in the first instant of a
# burst is the pool filling up, not the pace at which it drains
_MIN_SPAN_S = 1.0


class DispatchPace:
    """The dispatch rate of one queue (see the module docstring)."""

    def __init__(self, window_s: float) -> None:
        self._window = window_s
        self._rate = 0.0  # dispatched tokens per second (exponentially weighted)
        self._rate_at = 0.0
        # the same rate over the current span of dispatches only (`drain_rate`)
        self._drain = 0.0
        self._drain_at = 0.0
        self._drain_from: float | None = None
        self.dispatched_tokens = 0.0

    def note(self, cost: float, now: float) -> None:
        """``cost`` tokens went to the pool at ``now`` (queued or not): the dispatch rate."""
        dt = now - self._rate_at
        if dt > 0:
            self._rate *= math.exp(-dt / self._window)
            self._rate_at = now
        self._rate += cost / self._window
        self.dispatched_tokens += cost
        if cost > 0 and (self._drain_from is None or now - self._drain_at > self._window):
            self._drain, self._drain_from = 0.0, now  # the first after a quiet window
        if now > self._drain_at:
            self._drain *= math.exp(-(now - self._drain_at) / self._window)
            self._drain_at = now
        self._drain += cost / self._window

    def rate(self, now: float) -> float:
        """Dispatched tokens per second, averaged over about the rate window."""
        dt = now - self._rate_at
        return self._rate * math.exp(-dt / self._window) if dt > 0 else self._rate

    def drain_rate(self, now: float) -> float:
        """Tokens per second the queue drains at: the dispatch rate over the current span of
        dispatches (one after a window without any starts afresh), divided by the part of the
        window the span covers. A weighted average that starts at 0 reads low by
        1 - e^(-span/window) until the span is a few windows long: in the first second of a
        burst a tenth of the real pace, and shed clients were told 60 s for a queue that
        drained in 6. A span is taken as at least `_MIN_SPAN_S`."""
        if self._drain_from is None:
            return 0.0
        rate = max(0.0, self._drain) * math.exp(-max(0.0, now - self._drain_at) / self._window)
        span = max(now - self._drain_from, _MIN_SPAN_S)
        return rate / -math.expm1(-span / self._window)

    def give_back(self, tokens: float, now: float) -> None:
        """``tokens`` dispatched were not spent (`FlowQueue.refund`): out of the rates, never
        below zero for the dispatch rate."""
        self.note(-tokens, now)
        self._rate = max(0.0, self._rate)
