"""A replica ejected because nothing answered there (refused, /health failing or silent,
frozen) is back in rotation when its /health answers again; one ejected for what its requests
got (failures, a credentials refusal) comes back half-open, one trial at a time."""

from __future__ import annotations

from gateway.replicas import HealthRules, Replica

URL = "http://127.0.0.1:9001"


def test_found_down_by_its_health_checks_is_back_at_its_first_answer() -> None:
    r = Replica("p", URL, HealthRules())
    r.mark_down(0.0, request=False)  # /health refused: the process is gone
    assert r.state == "ejected" and not r.available(0.5)
    r.probe_recovered()  # restarted: /health answers
    assert (r.state, r.down, r.failures) == ("healthy", False, 0)
    leases = [r.acquire(10) for _ in range(3)]  # several at once: no trial to wait for
    assert r.available(0.6)
    for lease in leases:
        lease.release()


def test_a_request_refused_a_connection_is_back_at_its_first_answer() -> None:
    r = Replica("p", URL, HealthRules())
    r.mark_down(0.0, gone=True)
    r.probe_recovered()
    assert r.state == "healthy"


def test_ejected_for_its_answers_comes_back_on_trial() -> None:
    r = Replica("p", URL, HealthRules())
    r.mark_down(0.0)  # e.g. it refused the gateway's credentials: its /health needs none
    r.probe_recovered()
    assert r.state == "half_open"
    failing = Replica("p", URL, HealthRules())
    for t in range(3):
        failing.record_failure(float(t))
    failing.mark_down(3.0, request=False)  # found down too, once ejected for failures
    failing.probe_recovered()
    assert failing.state == "half_open"


def test_gone_then_failing_is_judged_as_failing() -> None:
    """A replica back from being gone whose requests then fail is ejected by them, and
    comes back on trial."""
    r = Replica("p", URL, HealthRules())
    r.mark_down(0.0, request=False)
    r.probe_recovered()
    for t in range(3):
        r.record_failure(1.0 + t)
    assert r.state == "ejected"
    r.probe_recovered()
    assert r.state == "half_open"
