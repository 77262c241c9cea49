"""A replica whose requests wait for their first event with nothing coming back is named
before kvgate ejects it: where it exports no engine counters (vLLM ``--disable-log-stats``) the
counter-based "engine hung" rule never fires, and the blind-stall rule ejects only after
``health.stall_after_s``. Read from the doctor's ticks (the leases' ages, and a count that moves
whenever anything came back from the replica)."""

from __future__ import annotations

from gateway.doctor.findings import Context
from gateway.doctor.history import History, read_tick
from gateway.doctor.replica_rules import classify_replica
from gateway.doctor.window import ReplicaStats, summarise
from gateway.lease import Lease
from tests.unit.doctor.test_history import Fleet
from tests.unit.doctor.test_rules import CTX, TH, replica


def _waiting(f: Fleet, age_s: float) -> Lease:
    """A stream sent to replica 1 `age_s` seconds ago, nothing back yet."""
    lease = f.reps[0].acquire(100, stream=True, now=f.now)
    lease.on_stall(lambda: None)
    f.src.lease_clock = lambda: f.now  # the leases' clock is the test's
    lease.since = f.now - age_s
    return lease


def _stats(f: Fleet, seconds: int, answer_at: int | None = None) -> ReplicaStats:
    """Replica 1's window numbers after one tick a second for `seconds` (no scrape: a replica
    without engine counters); `answer_at`: another request there got its first event then."""
    h = History(1.0, 120.0)
    for i in range(seconds):
        if i == answer_at:
            f.reps[0].acquire(10, stream=True, now=f.now).first_token()
        h.append(read_tick(f.src, f.now, h.layout, False, None))
        f.now += 1.0
    (st,) = [x for x in summarise(list(h.ticks), 60.0, stale_after_s=1.5).replicas
             if x.id == f.reps[0].id]
    return st


def test_a_request_waiting_with_nothing_back_is_named_before_ejection() -> None:
    f = Fleet()
    _waiting(f, 5.0)
    st = _stats(f, 21)
    assert st.waited_s >= 20.0 and st.quiet_s == 20.0
    found = classify_replica(st, TH, CTX)
    assert found[0].cls == "down" and found[0].severity == "critical"
    summary = found[0].summary
    assert summary.startswith(f"requests waiting for a first token on {f.reps[0].id} for 2")
    assert "nothing returned for 20 s" in summary and "60 s" in summary
    assert "restart its vLLM process" in found[0].action
    assert found[0].evidence[0].metric == "kvgate_replica_oldest_wait_seconds"


def test_a_replica_that_answered_meanwhile_is_not_hung() -> None:
    # one request queued long behind others that the replica serves: something came back 5 s
    # ago, so only 5 s of silence; a long queue is not a hang
    f = Fleet()
    _waiting(f, 5.0)
    st = _stats(f, 21, answer_at=15)
    assert st.waited_s >= 20.0 and st.quiet_s == 5.0
    assert all("first token" not in x.summary for x in classify_replica(st, TH, CTX))


def test_no_waiting_request_no_wait() -> None:
    f = Fleet()
    lease = _waiting(f, 30.0)
    lease.first_token()  # answered: it no longer waits
    lease.release()
    st = _stats(f, 5)
    assert st.waited_s == 0.0
    assert f.reps[0].oldest_wait_s(1e9) == 0.0


def test_the_rule_on_numbers_and_stall_detection_off() -> None:
    # stats-less (its /metrics without vllm:*), 40 s waiting, 30 s silent
    st = replica(no_stats=True, fresh=0, stale_share=1.0, requests=0.0, waited_s=40.0,
                 quiet_s=30.0)
    (f, *_) = classify_replica(st, TH, Context(stall_after_s=None))
    assert f.summary.startswith("requests waiting for a first token on r1 for 40 s, nothing "
                                "returned for 30 s (it exports no engine counters")
    assert "stall detection is off" in f.summary and "drain it" in f.action
    short = replica(waited_s=40.0, quiet_s=TH.hung_s - 1)
    assert all("first token" not in x.summary for x in classify_replica(short, TH, CTX))
