"""How late other gateways' sends reach this one: the window of flow control's unseen-sends
margin (`routing.flow.unseen`).

``flow.peer_lag_ms`` when set. Else the shared state's own figure: a peer's send is in its
next batch (at most a flush interval later) and applied here the batch's apply lag after that
(`gateway.fleet.stats`: written to Redis -> applied here, on Redis's clock), so the flush
interval plus the 99th percentile of the recent apply lags, at least the sync window
(`SyncSettings.window_s`, what the routing's turns use), taken again at most once a second.
"""

from __future__ import annotations

from gateway.fleet.sync import RouteSync

__all__ = ["PeerLag"]

_EVERY_S = 1.0  # how often the percentile is taken again
_MAX_S = 2.0  # never longer (a stalled reader's lags say nothing about the next burst)


class PeerLag:
    def __init__(self, sync: RouteSync, fixed_ms: float | None = None) -> None:
        self._sync = sync
        self._fixed = fixed_ms / 1000.0 if fixed_ms is not None else None
        self._at = float("-inf")
        self._window = sync.settings.window_s

    def __call__(self, now: float) -> float:
        """The window, seconds."""
        if self._fixed is not None:
            return self._fixed
        if now - self._at >= _EVERY_S:
            self._at = now
            settings = self._sync.settings
            lags = sorted(self._sync.stats.recent_lags)
            p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0.0
            self._window = min(_MAX_S, max(settings.window_s,
                                           settings.flush_interval_s + p99))
        return self._window
