"""A replica ejected for failing requests keeps its other requests (it may still answer
them; cut all at once they spent the retry budget), found down by its health checks they
are cut; and a /health probe that times out with nothing else heard from a replica while
requests wait there marks it down (`Replica.frozen`).

Before: only `health.slow_threshold` slow probes in a row took a frozen replica out.
"""

from __future__ import annotations

from contextvars import Context

from gateway.replicas import HealthRules, Lease, Replica


def _waiting(replica: Replica, cut: list[str], name: str) -> Lease:
    lease = replica.acquire(100, stream=True, now=0.0)
    lease.on_stall(lambda: cut.append(name))
    return lease


def test_an_ejection_by_failures_leaves_the_others_waiting_there() -> None:
    """A replica failing some requests may still answer the others: cutting them all at one
    ejection spent the pool's retry budget at once (a storm's 504s,
    test_gateway_failover's storm). Found down by its health checks, they are cut."""
    replica = Replica("p", "http://127.0.0.1:9", HealthRules(failure_threshold=2))
    cut: list[str] = []
    _waiting(replica, cut, "waiting")
    answered = _waiting(replica, cut, "answered")
    answered.first_token()  # its stream started: never cut
    _waiting(replica, cut, "failing")  # (acquired last: the request judged now)
    replica.record_failure(1.0)
    replica.record_failure(1.0)
    assert replica.state == "ejected"
    assert cut == []
    replica.mark_down(2.0, request=False, reason="health check refused")
    assert cut == ["waiting"]  # (not the request judged in this context: its handler ends it)


def test_a_probe_hearing_nothing_with_requests_waiting_is_a_frozen_replica() -> None:
    replica = Replica("p", "http://127.0.0.1:9", HealthRules())
    cut: list[str] = []
    mark = replica.reply_mark()
    assert not replica.frozen(mark, 1.0, 5.0)  # nothing waits there: the slow-probe rule
    Context().run(_waiting, replica, cut, "waiting")  # (a request's task, not the prober's)
    mark = replica.reply_mark()
    replica.replies += 1  # (a scrape, a chunk) came meanwhile: alive
    assert not replica.frozen(mark, 1.0, 5.0) and cut == [] and replica.state == "healthy"
    assert replica.frozen(replica.reply_mark(), 2.0, 5.0)
    assert cut == ["waiting"]
    assert replica.down and replica.state == "ejected"
    assert replica.reason is not None and "no answer from it for 5 s" in replica.reason
