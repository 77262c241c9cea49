"""A half-open replica's trial is decided by a request sent since its ejection: one it held
from before does not decide it by failing late (`Lease.epoch`), nor holds it back once the
engine is seen working.
Each request is its own context, as each proxied request is its own task."""

from __future__ import annotations

from contextvars import Context

from gateway.replicas import HealthRules, Lease, Replica
from gateway.scrape import Sample

RULES = HealthRules(failure_threshold=2, eject_base_s=1.0, eject_max_s=4.0)


def replica() -> Replica:
    return Replica("p", "http://127.0.0.1:9001", RULES)


def failed_request(r: Replica, now: float) -> None:
    """One request sent to `r` (in the caller's context) that failed there."""
    r.acquire(10).release()
    r.record_failure(now)


def scraped(tokens: float) -> Sample:
    return Sample(running=1.0, waiting=0.0, generation_tokens=tokens, prompt_tokens=10.0)


def ejected_holding_one() -> tuple[Replica, Context, Lease]:
    """A replica ejected by two failures while a third request (in `held`) is in flight,
    its engine's tokens counted 500 then."""
    r = replica()
    r.record_scrape(scraped(500.0), 0.0)
    held = Context()
    lease = held.run(r.acquire, 10)
    for _ in range(2):
        Context().run(failed_request, r, 0.0)
    assert r.state == "ejected"
    return r, held, lease


def test_a_held_request_does_not_hold_the_trial_back_once_the_engine_works() -> None:
    r, _, _ = ejected_holding_one()
    assert not r.available(1.0)  # its engine not seen working since: it may be hung
    r.record_scrape(scraped(530.0), 1.0)  # tokens moved since the ejection
    assert r.available(1.0) and r.state == "half_open"
    trial = Context().run(r.acquire, 10)
    assert not r.available(1.0)  # one trial at a time
    trial.release()


def test_a_held_request_holds_the_trial_back_while_nothing_moves() -> None:
    r, _, lease = ejected_holding_one()
    r.record_scrape(scraped(500.0), 1.0)
    assert not r.available(1.0)
    lease.release()  # it ended (cut in time: a stall, an idle timeout)
    assert r.available(1.0)


def test_its_late_failure_does_not_decide_the_trial() -> None:
    r, held, lease = ejected_holding_one()
    r.record_scrape(scraped(530.0), 1.0)
    assert r.available(1.0)
    trial_ctx = Context()
    trial = trial_ctx.run(r.acquire, 10)
    failed = r.failed
    held.run(r.record_failure, 1.5)  # the held request fails now (an idle cut, a reset)
    lease.release()
    assert r.state == "half_open" and r.ejections == 1
    assert r.failed == failed + 1  # counted all the same
    trial_ctx.run(r.record_success)
    trial.release()
    assert r.state == "healthy"


def test_the_trial_s_own_failure_still_ejects() -> None:
    r, _, _ = ejected_holding_one()
    r.record_scrape(scraped(530.0), 1.0)
    assert r.available(1.0)
    Context().run(failed_request, r, 1.0)
    assert r.state == "ejected" and r.ejections == 2


def test_a_trial_answers_once_its_first_token_came() -> None:
    r = replica()
    for _ in range(2):
        Context().run(failed_request, r, 0.0)
    assert r.available(1.0) and r.state == "half_open"
    assert not r.trial_answering(1.0)  # nothing sent since the ejection
    trial = Context().run(r.acquire, 10)
    assert not r.available(1.0) and not r.trial_answering(1.0)  # it waits for its prefill
    trial.first_token()
    assert not r.available(1.0) and r.trial_answering(1.0)  # judged at its end: answering
    other = Context().run(r.acquire, 10)  # a pick with nothing else available took it
    assert not r.trial_answering(1.0)
    other.release()  # ended unanswered (a client gone): its wait is counted off too
    assert r.trial_answering(1.0) and r.current_waiting == 0
    trial.release()
    assert r.current == 0 and r.current_waiting == 0 and not r.trial_answering(1.0)


def test_an_ejection_forgets_the_waiting_trials() -> None:
    r = replica()
    for _ in range(2):
        Context().run(failed_request, r, 0.0)
    held = Context().run(r.acquire, 10)  # sent on trial, then the replica is out again
    r.eject(1.0)
    assert r.current_waiting == 0
    held.first_token()  # an answer of the epoch before counts nothing off
    held.release()
    assert r.current == 0 and r.current_waiting == 0
