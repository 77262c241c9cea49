"""A replica whose scrapes carry no engine counters (``--disable-log-stats``, every scrape
None): found stalled once streams of kvgate's wait there with nothing from its engine for
`stall_after_s`, their cuts called; not while a chunk or an answer moves, not with a
non-streamed request among them (no sign either way), never with the rule off."""

from __future__ import annotations

import contextvars

from gateway.replicas import HealthRules, Replica

RULES = HealthRules(failure_threshold=3, eject_base_s=1.0, eject_max_s=4.0, stall_after_s=2.0)


def _blind(rules: HealthRules = RULES) -> tuple[Replica, list[str]]:
    return Replica("p", "http://127.0.0.1:9001", rules), []


def test_waiting_streams_with_nothing_from_it_make_a_stall() -> None:
    r, cut = _blind()
    # sent from another task (the scrape's is not the request's: `_cut_waiting` skips the
    # lease its own task holds)
    lease = contextvars.copy_context().run(r.acquire, 100, True, 0.0)
    lease.on_stall(lambda: cut.append("a"))
    for t in (0.0, 1.0):
        r.record_scrape(None, t)
        assert not r.stalled
    r.record_scrape(None, 2.5)
    assert r.stalled and r.state == "ejected" and r.stalls == 1
    assert cut == ["a"]


def test_a_streamed_chunk_or_answer_is_progress() -> None:
    r, _ = _blind()
    r.acquire(100, stream=True, now=0.0)
    r.record_scrape(None, 0.0)
    r.streamed += 1  # another request's chunk
    r.record_scrape(None, 1.5)
    r.record_scrape(None, 3.0)
    assert not r.stalled
    r.acquire(100, stream=True, now=3.0).first_token()
    r.record_scrape(None, 4.0)
    assert not r.stalled


def test_a_whole_answer_waiting_there_says_nothing() -> None:
    r, _ = _blind()
    r.acquire(100, stream=True, now=0.0)
    r.acquire(100, stream=False, now=0.0)
    for t in (0.0, 3.0, 6.0):
        r.record_scrape(None, t)
    assert not r.stalled


def test_off_when_stall_after_s_is_off() -> None:
    r, _ = _blind(HealthRules(failure_threshold=3, eject_base_s=1.0, eject_max_s=4.0,
                              stall_after_s=None))
    r.acquire(100, stream=True, now=0.0)
    for t in (0.0, 3.0, 6.0):
        r.record_scrape(None, t)
    assert not r.stalled
