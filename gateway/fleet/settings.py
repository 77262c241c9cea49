"""The shared routing state's settings (`SyncSettings`, built from the ``sync`` config section)
and the windows derived from them: how late a peer's record is applied here (`window_s`), how
long a contested pick is held per rank (`hold_s`), how often an urgent batch may go out
(`urgent_gap_s`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIN_WINDOW_S", "SyncSettings"]

# the sync window's floor (`SyncSettings.window_s`): a peer's pick is applied here 14-18 ms
# after it at p99 live with a 5 ms flush interval, not the two intervals' 10 ms
MIN_WINDOW_S = 0.02
# urgent batches: at most this many per hold window (`SyncSettings.urgent_gap_s`)
URGENT_GAPS = 4


@dataclass(frozen=True, slots=True)
class SyncSettings:
    flush_interval_s: float = 0.02
    heartbeat_s: float = 0.5
    stale_after_s: float = 2.0
    stream_maxlen: int = 20_000
    stream_max_mb: int = 64  # the stream's share of Redis's memory (`gateway.fleet.budget`)
    catchup_entries: int = 5_000
    max_entries_per_tick: int = 256
    timeout_s: float = 1.0
    # the gateway holds a contested pick rank x the hold window before making it
    # (`routing.router.Router.defer_s`; off while flow control schedules the picks)
    defer: bool = False
    # how late the record of a pick a peer may hold for is applied, at most: such a route is
    # published at once and read at once by a gateway holding a pick (`hold_s`)
    hold_window_s: float = 0.02

    @property
    def window_s(self) -> float:
        """How late a peer's batched record is applied here, at most (p99): the sync window
        of the bursts and the turns (the held picks wait `hold_s`). Up to an interval in the
        publisher's outbox, up to one more before a busy reader's next read, and transit and
        event-loop delays that do not shrink with the interval: measured live
        (`loadtest.held_lag`, round 7) p99 39 ms at 20 ms, 21 ms at 10 ms, 14-18 ms at 5 ms;
        so two intervals, never less than MIN_WINDOW_S."""
        return max(2 * self.flush_interval_s, MIN_WINDOW_S)

    @property
    def hold_s(self) -> float:
        """The held picks' window: rank r holds a contested pick r x this. The routes of the
        picks peers may hold for (contested ones) are published at once, not batched, and a
        gateway holding a pick reads at once: a round trip and the event loops' delays, not
        the batches' intervals: 2-7 ms at the median and covered by 20 ms in the harness's
        loaded process (`loadtest.held_lag`, docs/shared-state-measurements.md "The live
        window"). Never more than the sync window (a record a batch late)."""
        return min(self.hold_window_s, self.window_s)

    @property
    def urgent_gap_s(self) -> float:
        """The least time between two batches when a route is urgent (`Router.on_urgent`):
        one goes out at once, the ones queued within this of the last batch wait for its end
        and go together. Urgent batches then cost at most one Redis round trip per gap (200
        a second by default), not one per contested pick (a batch each at 2,000 requests/s,
        ~170 a second over two gateways, and growing with the rate: `loadtest.sync_cost
        --step 1`). A quarter of the hold window: an urgent route waits at most that, and the
        rest of the window is the round trip and the event loops' delays a held pick waits
        for (2-7 ms at the median live; docs/shared-state-measurements.md "The live window")."""
        return self.hold_s / URGENT_GAPS
