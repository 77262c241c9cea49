"""The windows of a gateway's router: the sync window (`SyncSettings.window_s`: how late a
batched record arrives, two flush intervals, never less than the floor measured live: a peer's
pick is applied 14-18 ms after it at p99 with a 5 ms interval) bounds the bursts and the turns;
the hold window (`SyncSettings.hold_s`: the routes peers hold for are published and read at
once) is what a contested pick is held per rank, never more than the sync window."""

from __future__ import annotations

import time

import pytest

from gateway.fleet.settings import MIN_WINDOW_S, SyncSettings
from gateway.fleet.sync import RouteSync
from routing.peers import RouteRecord
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

VIEWS = [ReplicaView(id=f"r{i}", pool="p") for i in range(8)]


def _rank1_wait(flush_s: float, hold_s: float | None = None) -> float:
    """How long the second of two gateways (members "a" and "b") holds a cold pick on an idle
    fleet in a burst, its router set up by a `RouteSync` (nothing is sent: not started)."""
    router = Router(RouterConfig())
    hold = SyncSettings().hold_window_s if hold_s is None else hold_s
    RouteSync(router, "redis://127.0.0.1:1", "t",
              SyncSettings(flush_interval_s=flush_s, defer=True, hold_window_s=hold),
              own_loads=dict,
              known=lambda r: True, clock=time.monotonic, member="b")
    router.apply_peer_load("a", {}, 0.0)
    # a burst of the lower rank's (64 routes: collisions that outweigh a hold of 0.1 s,
    # `routing.holds`)
    router.apply_peer_routes([RouteRecord(f"r{i % 8}", (777_777 + i,), 0) for i in range(64)],
                             "a", 0.999)
    hashes = tuple(range(1, 41))
    f = RequestFeatures(model="m", block_hashes=hashes, prompt_tokens=64 * 40 + 10,
                        prefix_key=hashes[-1])
    return router.defer_s(f, VIEWS, 1.0)


@pytest.mark.parametrize("flush_ms", [5.0, 10.0, 20.0, 50.0])
@pytest.mark.parametrize("hold_ms", [5.0, 20.0, 100.0])
def test_a_held_pick_waits_the_hold_window_never_more_than_the_sync_window(
    flush_ms: float, hold_ms: float,
) -> None:
    window = max(2 * flush_ms / 1000, MIN_WINDOW_S)
    settings = SyncSettings(flush_interval_s=flush_ms / 1000, hold_window_s=hold_ms / 1000)
    assert settings.window_s == window
    assert settings.hold_s == min(hold_ms / 1000, window)
    assert _rank1_wait(flush_ms / 1000, hold_ms / 1000) == pytest.approx(
        min(hold_ms / 1000, window), rel=0.01)


@pytest.mark.parametrize(("flush_ms", "hold_ms", "gap_ms"),
                         [(20.0, 20.0, 5.0), (5.0, 40.0, 5.0), (20.0, 8.0, 2.0)])
def test_urgent_batches_are_a_quarter_of_the_hold_window_apart(
    flush_ms: float, hold_ms: float, gap_ms: float,
) -> None:
    # an urgent route waits at most this for the batch it joins (the hold window, capped by
    # the sync window, is what the held pick waiting for it allows)
    settings = SyncSettings(flush_interval_s=flush_ms / 1000, hold_window_s=hold_ms / 1000)
    assert settings.urgent_gap_s == pytest.approx(gap_ms / 1000)


def test_by_default_a_held_pick_waits_half_the_sync_window() -> None:
    # the routes it waits for are not batched: 20 ms, where two 20 ms intervals were 40
    assert SyncSettings().window_s == 0.04
    assert _rank1_wait(SyncSettings().flush_interval_s) == pytest.approx(0.02, rel=0.01)


class _NoPools:
    def described(self) -> list[object]:
        return []


@pytest.mark.parametrize(("sync", "flow", "holds"), [
    ({}, False, True),  # the default: held in a burst
    ({"hold_picks": False}, False, False),  # switched off: turns instead
    ({}, True, False),  # flow control schedules the picks
])
def test_a_gateway_holds_picks_unless_switched_off_or_under_flow_control(
    sync: dict[str, object], flow: bool, holds: bool,
) -> None:
    from gateway.config import load_config
    from gateway.runtime import _route_sync

    cfg = load_config(None, overrides={
        "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "sync": sync, "flow": {"enabled": flow},
    }, environ={"KVGATE_REDIS_URL": "redis://127.0.0.1:1"})
    router = Router(RouterConfig())
    made = _route_sync(cfg, router, _NoPools(), {}, time.monotonic)  # type: ignore[arg-type]
    assert made is not None
    assert made.settings.defer is holds and router.defers is holds


def test_the_hold_window_is_a_setting() -> None:
    from gateway.config import load_config
    from gateway.runtime import _route_sync

    cfg = load_config(None, overrides={
        "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "sync": {"hold_window_ms": 7},
    }, environ={"KVGATE_REDIS_URL": "redis://127.0.0.1:1"})
    router = Router(RouterConfig())
    made = _route_sync(cfg, router, _NoPools(), {}, time.monotonic)  # type: ignore[arg-type]
    assert made is not None and made.settings.hold_s == 0.007
