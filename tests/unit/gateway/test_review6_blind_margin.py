"""`BlindWatch` waits at least `BLIND_MARGIN` x the longest first-event wait served there
(lately: `Lease.first_token` lets it decay)."""

from __future__ import annotations

from gateway.replica_health import HealthRules
from gateway.replicas import Replica
from gateway.stall import BLIND_MARGIN, BlindWatch


def test_a_served_wait_raises_the_silence_judged_a_stall() -> None:
    watch = BlindWatch(2.0)
    assert not watch.observe(5, True, 0.0, longest_first_s=3.0)
    assert not watch.observe(5, True, 2.5, longest_first_s=3.0)  # past after_s: not yet
    assert not watch.observe(5, True, BLIND_MARGIN * 3.0 - 0.1, longest_first_s=3.0)
    assert watch.observe(5, True, BLIND_MARGIN * 3.0, longest_first_s=3.0)


def test_without_history_after_s_alone_judges() -> None:
    watch = BlindWatch(2.0)
    assert not watch.observe(1, True, 0.0)
    assert watch.observe(1, True, 2.0)


def test_a_long_wait_long_past_fades_from_the_replica_history() -> None:
    replica = Replica("p", "http://127.0.0.1:9001", HealthRules(stall_after_s=2.0))
    replica.longest_first_s = 300.0  # one wait during an incident
    for _ in range(200):  # streams answered at once since
        replica.acquire(10, stream=True).first_token()
    assert replica.longest_first_s < 1.0
    lease = replica.acquire(10, stream=False)  # a whole answer's wait is no evidence
    assert lease.sent_at is None
    lease.first_token()
    assert replica.longest_first_s < 1.0
    assert replica.inflight_prefill == 0
