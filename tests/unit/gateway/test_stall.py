"""Stall detection (`gateway.stall`) and what a stalled replica does (`Replica.record_scrape`):
scrape samples and times fed in, no sleeps, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from gateway.replicas import HealthRules, Replica
from gateway.scrape import Sample
from gateway.stall import StallWatch

AFTER = 30.0


def busy(tokens: float | None, running: float = 2.0, prompt: float | None = 100.0) -> Sample:
    return Sample(running=running, waiting=0.0, generation_tokens=tokens, prompt_tokens=prompt)


def feed(watch: StallWatch, samples: Sequence[tuple[float, Sample | None]], inflight: int = 0,
         ) -> list[bool]:
    return [watch.observe(s, inflight, t) for t, s in samples]


def test_frozen_counters_with_requests_running_are_a_stall_after_the_delay() -> None:
    w = StallWatch(AFTER)
    assert feed(w, [(0.0, busy(500)), (10.0, busy(500)), (29.9, busy(500)),
                    (30.0, busy(500)), (45.0, busy(500))]) == [False, False, False, True, True]


def test_tokens_moving_is_progress_however_slow() -> None:
    w = StallWatch(AFTER)
    assert not any(feed(w, [(t * 20.0, busy(500 + t)) for t in range(10)]))


def test_a_prefill_completing_is_progress() -> None:
    w = StallWatch(AFTER)
    assert feed(w, [(0.0, busy(500, prompt=100)), (25.0, busy(500, prompt=9000)),
                    (50.0, busy(500, prompt=9000))]) == [False, False, False]


def test_the_clock_starts_when_the_replica_is_first_seen_busy() -> None:
    # idle for an hour at the same count, then a request arrives: not stalled at once
    w = StallWatch(AFTER)
    idle = [(t * 60.0, busy(500, running=0)) for t in range(60)]
    assert not any(feed(w, idle))
    assert w.observe(busy(500, running=1), 0, 3600.0) is False
    assert w.observe(busy(500, running=1), 0, 3629.0) is False
    assert w.observe(busy(500, running=1), 0, 3630.0) is True


def test_requests_waiting_count_as_busy() -> None:
    w = StallWatch(AFTER)
    queued = Sample(running=0.0, waiting=3.0, generation_tokens=500.0)
    assert feed(w, [(0.0, queued), (40.0, queued)]) == [False, True]


def test_kvgate_s_own_requests_in_flight_count_as_busy() -> None:
    w = StallWatch(AFTER)
    assert feed(w, [(0.0, busy(500, running=0)), (40.0, busy(500, running=0))],
                inflight=1) == [False, True]


def test_a_failed_scrape_starts_the_evidence_over() -> None:
    w = StallWatch(AFTER)
    assert feed(w, [(0.0, busy(500)), (20.0, None), (31.0, busy(500)), (60.0, busy(500)),
                    (61.0, busy(500))]) == [False, False, False, False, True]


def test_no_generation_counter_is_never_a_stall() -> None:
    w = StallWatch(AFTER)
    assert not any(feed(w, [(t * 40.0, busy(None)) for t in range(5)]))


def test_a_counter_going_back_is_a_restart_and_a_new_baseline() -> None:
    w = StallWatch(AFTER)
    assert feed(w, [(0.0, busy(500)), (20.0, busy(3, prompt=10)), (40.0, busy(3, prompt=10)),
                    (50.0, busy(3, prompt=10))]) == [False, False, False, True]


def test_disabled_never_judges() -> None:
    for after in (None, 0.0):
        w = StallWatch(after)
        assert not any(feed(w, [(t * 100.0, busy(500)) for t in range(5)]))


# -- the replica's side ---------------------------------------------------------------------
RULES = HealthRules(failure_threshold=3, eject_base_s=1.0, eject_max_s=4.0, stall_after_s=AFTER)


def replica() -> Replica:
    return Replica("p", "http://127.0.0.1:9001", RULES)


def test_a_stalled_replica_is_ejected_kept_out_and_back_once_it_moves() -> None:
    r = replica()
    r.record_scrape(busy(500), 0.0)
    r.record_scrape(busy(500), 30.0)
    assert r.stalled and r.stalls == 1 and r.state == "ejected"
    assert r.condition(31.0) == "its engine stopped making progress"
    r.record_scrape(busy(500), 60.0)  # still stalled: one stall, one ejection
    assert r.stalls == 1 and r.ejections == 1
    assert not r.available(60.0)  # its back-off is long over: kept out while stalled
    r.probe_recovered()  # /health answers 200 (a hung engine's does)
    assert r.state == "ejected"
    r.record_scrape(busy(501), 61.0)  # a token: it moves again
    assert not r.stalled
    assert r.available(61.0) and r.state == "half_open"  # one trial decides


def test_a_stall_cuts_the_requests_that_got_nothing_yet() -> None:
    r = replica()
    cut: list[str] = []
    waiting, answered, ended = r.acquire(10, stream=False), r.acquire(10), r.acquire(10, False)
    for name, lease in (("waiting", waiting), ("answered", answered), ("ended", ended)):
        lease.on_stall(partial(cut.append, name))
    answered.first_token()
    ended.release()
    r.record_scrape(busy(500), 0.0)
    r.record_scrape(busy(500), 31.0)
    assert cut == ["waiting"]
    assert not r.cuttable


def test_a_failed_scrape_while_hung_does_not_eject() -> None:
    r = replica()
    r.record_scrape(busy(500), 0.0)
    for t in range(1, 10):
        r.record_scrape(None, t * 10.0)  # /metrics unreadable: fail open
    r.record_scrape(busy(500), 100.0)
    assert not r.stalled and r.state == "healthy"
