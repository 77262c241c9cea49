"""`Replica.silent_for`: how long requests have waited on a replica with nothing heard from
it (`ReplicaView.silent_s`, which the router reads to leave a frozen replica out)."""

from __future__ import annotations

from gateway.replicas import HealthRules, Replica
from gateway.scrape import Sample


def _replica() -> Replica:
    return Replica("p", "http://a:1", HealthRules())


def _counters(tokens: float) -> Sample:
    return Sample(generation_tokens=tokens, prompt_tokens=0.0)


def test_nothing_waiting_is_never_silent() -> None:
    r = _replica()
    assert r.silent_for(10.0) == 0.0
    lease = r.acquire(100)
    lease.first_token()
    lease.release()
    assert r.silent_for(20.0) == 0.0


def test_a_waiting_request_counts_from_when_it_was_noticed_until_something_is_heard() -> None:
    r = _replica()
    r.acquire(100)
    assert r.silent_for(1.0) == 0.0  # noticed now
    assert r.silent_for(3.5) == 2.5
    second = r.acquire(100)
    second.first_token()  # another request's first token: the replica works
    assert r.silent_for(4.0) == 0.0
    assert r.silent_for(6.0) == 2.0


def test_engine_counters_moving_are_heard_and_standing_still_are_not() -> None:
    r = _replica()
    r.record_scrape(_counters(10.0), 0.0)
    r.acquire(100, stream=False)  # whole answers say nothing until they come...
    r.silent_for(1.0)
    r.record_scrape(_counters(50.0), 2.0)  # ...but its engine decodes
    assert r.silent_for(3.0) == 1.0
    r.record_scrape(_counters(50.0), 4.0)  # counters stopped: a hung engine
    assert r.silent_for(9.0) == 7.0


def test_whole_answers_without_engine_counters_are_no_evidence() -> None:
    r = _replica()  # a backend whose /metrics carry no vLLM counters (or none scraped yet)
    r.acquire(100, stream=False)
    r.silent_for(1.0)
    assert r.silent_for(60.0) == 0.0
    r.acquire(100)  # a stream waiting: its first token would have said
    r.silent_for(61.0)
    assert r.silent_for(65.0) == 4.0


def test_the_view_carries_it() -> None:
    r = _replica()
    r.acquire(100)
    r.view(1.0)
    assert r.view(4.0).silent_s == 3.0


def test_told_when_the_first_request_was_sent_it_counts_from_then() -> None:
    r = _replica()
    r.acquire(100, now=2.0)
    r.acquire(100, now=3.0)  # joins the wait: the count goes on from the first
    assert r.silent_for(5.0) == 3.0
    first = r.acquire(100, now=6.0)
    first.first_token()
    assert r.silent_for(6.5) == 0.0
