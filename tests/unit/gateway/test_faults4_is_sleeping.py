"""A replica's dev-mode /is_sleeping answer (`Replica.record_is_sleeping`): asleep, it takes
no request and its requests that got nothing yet are cut; a scraped page without the sleep
gauge does not wake it (before the rule, such a page woke a replica its own answers had
found asleep only); its "awake" brings it back."""

from __future__ import annotations

from contextvars import Context

from gateway.replicas import HealthRules, Replica
from gateway.scrape import Sample


def test_is_sleeping_takes_it_out_until_it_says_awake() -> None:
    replica = Replica("p", "http://127.0.0.1:9", HealthRules())
    cut: list[str] = []

    def waiting() -> None:
        replica.acquire(100, stream=False, now=0.0).on_stall(lambda: cut.append("cut"))

    Context().run(waiting)  # (a request's task, not the prober's)
    replica.record_is_sleeping(True)
    assert cut == ["cut"] and not replica.available(1.0)
    assert replica.reason is not None and "/is_sleeping" in replica.reason
    assert replica.record_scrape(Sample(running=0.0, waiting=0.0), 1.0) == "asleep"
    assert not replica.available(2.0)  # a page without the gauge says nothing
    replica.record_is_sleeping(False)
    assert replica.available(3.0) and replica.reason is None
