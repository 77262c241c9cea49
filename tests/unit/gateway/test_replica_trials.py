"""A half-open replica takes one trial request at a time: the requests sent on trial count,
not those a hung engine held from before its ejection, whose clients may wait for minutes
(gray failures, scenario 3: `loadtest.gray_failures`)."""

from __future__ import annotations

from gateway.replicas import HealthRules, Lease, Replica

POLICY = HealthRules(failure_threshold=3, eject_base_s=1.0, eject_max_s=4.0)


def ejected_with_old_requests(n: int) -> tuple[Replica, list[Lease]]:
    """A replica ejected at t=0 by three failures, `n` older requests still in flight."""
    r = Replica("p", "http://127.0.0.1:9001", POLICY)
    old = [r.acquire(10, stream=False) for _ in range(n)]
    for _ in range(3):
        r.record_failure(0.0)
    assert r.state == "ejected"
    return r, old


def test_requests_from_before_the_ejection_do_not_block_the_trial() -> None:
    r, _old = ejected_with_old_requests(2)
    assert r.available(1.5) and r.state == "half_open"  # the back-off expired
    trial = r.acquire(10)
    assert not r.available(1.6)  # one trial at a time
    trial.release()
    assert r.available(1.7)


def test_a_trial_that_succeeds_brings_the_replica_back() -> None:
    r, old = ejected_with_old_requests(1)
    assert r.available(1.5)
    trial = r.acquire(10)
    trial.first_token()
    r.record_success()
    trial.release()
    assert r.state == "healthy" and r.trials == 0
    old[0].release()
    assert r.inflight == 0 and r.trials == 0
