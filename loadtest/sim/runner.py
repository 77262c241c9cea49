"""Drives the pure engine in (scaled) wall-clock time and hands outputs to waiting handlers.

Simulated time = wall time since start x ``time_scale``. The loop commits every step that starts
before "now", sleeps until the last committed step ends, then delivers that step's outputs, so
the engine's timeline is exact and only delivery carries timer jitter (never accumulated).

`hold` is the engine-hang fault (a GPU kernel that never returns, a deadlocked collective):
the engine takes no step (a step under way ends), so no request gets a token and every
counter stays where it is, requests still running; aborts are queued, not applied (a stuck
engine core reads no abort), and simulated time stands still. Let go, it steps on from where
it stopped, the hang taken out of its timeline, and applies the aborts.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from loadtest.sim.engine import Engine
from loadtest.sim.spec import RequestOutput, RequestSpec

__all__ = ["EngineRunner", "Track"]


class Track:
    """One request in flight: its output queue and what metrics need."""

    __slots__ = ("arrival", "last_time", "queue")

    def __init__(self, arrival: float,
                 queue: asyncio.Queue[RequestOutput] | None = None) -> None:
        # the n sequences of one `n > 1` request share their handler's queue
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue() if queue is None else queue
        self.arrival = arrival
        self.last_time: float | None = None


Observer = Callable[[RequestOutput, Track], None]


class EngineRunner:
    def __init__(
        self,
        engine: Engine,
        time_scale: float = 1.0,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < time_scale < math.inf:  # nan passed `<= 0`
            raise ValueError("time_scale must be a finite number > 0")
        self.engine = engine
        self.time_scale = time_scale
        self._observer = observer
        self._clock = clock
        self._wall0 = clock()
        self._sim0 = engine.now
        self._tracks: dict[str, Track] = {}
        self._wake = asyncio.Event()
        self._held_at: float | None = None  # wall time the hang began (`hold`)
        self._held_aborts: list[str] = []

    def sim_now(self) -> float:
        wall = self._clock() if self._held_at is None else self._held_at
        return self._sim0 + (wall - self._wall0) * self.time_scale

    def hold(self, on: bool) -> None:
        """Hang the engine (`on`) or let it go on (see the module's doc)."""
        if on and self._held_at is None:
            self._held_at = self._clock()
        elif not on and self._held_at is not None:
            self._wall0 += self._clock() - self._held_at  # the hang is not simulated time
            self._held_at = None
            aborts, self._held_aborts = self._held_aborts, []
            for request_id in aborts:
                self.engine.abort(request_id)
            self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self._tracks)

    def submit(self, spec: RequestSpec,
               queue: asyncio.Queue[RequestOutput] | None = None) -> Track:
        now = self.sim_now()
        track = Track(now, queue)
        self.engine.add_request(spec, now)
        self._tracks[spec.request_id] = track
        self._wake.set()
        return track

    def abort(self, request_id: str) -> None:
        """Abort (client gone, or dying); the handler gets a final "abort" output."""
        track = self._tracks.pop(request_id, None)
        if self._held_at is None:
            self.engine.abort(request_id)
        else:
            self._held_aborts.append(request_id)
        if track is not None:
            track.queue.put_nowait(RequestOutput(request_id, finish_reason="abort"))

    def abort_all(self) -> None:
        for request_id in list(self._tracks):
            self.abort(request_id)

    async def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.busy or self._held_at is not None:
                self._wake.clear()
                await self._wake.wait()
                continue
            outs = engine.advance(max(self.sim_now(), engine.now + 1e-12))
            await self._sleep_until(engine.now)
            self._deliver(outs)

    async def _sleep_until(self, sim_time: float) -> None:
        while True:
            delay = (sim_time - self.sim_now()) / self.time_scale
            if delay <= 0:
                return
            await asyncio.sleep(delay)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        tracks, observer = self._tracks, self._observer
        for out in outs:
            track = tracks.get(out.request_id)
            if track is None:
                continue  # aborted meanwhile
            if observer is not None:
                observer(out, track)
            track.last_time = out.time
            if out.finish_reason is not None:
                del tracks[out.request_id]
            track.queue.put_nowait(out)
