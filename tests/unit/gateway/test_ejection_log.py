"""A replica taken out by its requests says so in the log, once per ejection, with why.

Before: only the health checks' decisions were logged (`replica down`, `/health` refused or
answered 503) and the way back (`replica answers /health again`): a replica ejected for failed
requests (three 5xx in a row, a dead engine's 500, a wrong model's 404, a refused connection)
went out silently, and an operator read lines saying it was back from an outage the log never
showed. Real `Replica`s and verdicts, the time passed in."""

from __future__ import annotations

import logging

import pytest

from gateway.replicas import HealthRules, Replica
from gateway.verdicts import judge

POLICY = HealthRules(failure_threshold=3, eject_base_s=1.0, eject_max_s=4.0)
DEAD = b'{"error": {"message": "The server had an error while processing your request."}}'


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, str]]:
    return [(r.levelname, r.getMessage(), r.__dict__["replica"])
            for r in caplog.records if r.name == "gateway.replicas"]


def test_failed_requests_eject_with_one_line_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = Replica("p", "http://10.0.0.1:8000", POLICY)
    with caplog.at_level(logging.INFO, logger="gateway.replicas"):
        r.record_failure(0.0)
        r.record_failure(0.1)
        assert _lines(caplog) == []  # not ejected yet
        r.record_failure(0.2)
        r.record_failure(0.3)  # ejected already: nothing more
        assert _lines(caplog) == [
            ("WARNING", "replica ejected: 3 requests failed in a row; back in 1 s at the "
                        "earliest", "10.0.0.1:8000")]
        assert r.available(1.5)  # half-open: its trial fails
        r.acquire(1)
        r.record_failure(1.5)
    assert _lines(caplog)[1:] == [
        ("WARNING", "replica ejected: its trial request failed; back in 2 s at the earliest",
         "10.0.0.1:8000")]


def test_a_request_finding_it_down_says_why(caplog: pytest.LogCaptureFixture) -> None:
    r = Replica("p", "http://10.0.0.1:8000", POLICY)
    with caplog.at_level(logging.INFO, logger="gateway.replicas"):
        assert judge(r, 500, DEAD, 0.0) == "dead"
        assert judge(r, 500, DEAD, 0.1) == "dead"  # down already: one line
        r.probe_recovered()
        assert judge(r, 404, b"The model `m` does not exist.", 1.0) == "wrong_model"
        r.probe_recovered()
        r.mark_down(2.0)  # a connection refused (the proxy sets its reason after)
        r.probe_recovered()
        r.mark_down(6.0, request=False)  # health's own finding: health logs it
        r.probe_recovered()
        assert judge(r, 401, b"", 7.0) == "refused"  # warned about by the verdict, once
        r.probe_recovered()
        assert judge(r, 401, b"", 8.0) == "refused"
    assert _lines(caplog) == [
        ("WARNING", "replica down: its engine died (500)", "10.0.0.1:8000"),
        ("WARNING", "replica down: serves another model (404)", "10.0.0.1:8000"),
        ("WARNING", "replica down: a request could not connect to it", "10.0.0.1:8000")]
    assert [r.getMessage()[:50] for r in caplog.records if r.name == "gateway.verdicts"] == [
        "replica refused the gateway's credentials (401): s"]
