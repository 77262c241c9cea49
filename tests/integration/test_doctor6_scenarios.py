"""Today's scenarios as `python -m loadtest.bench_doctor` scores them (`doctor_scenarios`):
the expected finding named at its place with the cause's words, and nothing else named.

- ``blind-stall``: a hung engine on a replica started with ``--disable-log-stats``, found
  stalled on kvgate's own evidence (before: "its engine's token counters frozen", counters it
  never exported);
- ``redis-password``: a password in KVGATE_REDIS_URL for a Redis without requirepass, reported
  with /readyz merged in as the CLI does (before: "Redis refuses kvgate's commands, read the
  log");
- ``healthy-routes``: Anthropic messages and count_tokens (streamed flag too), rerank, score,
  tokenize, detokenize, pooling and audio uploads: requests without a first token to time,
  nothing to name.
"""

from __future__ import annotations

import json

import pytest

from loadtest.doctor_scenarios import SCENARIOS, Running, found, wrong_classes

SCALE = 20.0
LOAD_S = 5.0
THRESHOLDS = {"overhead_p99_s": 0.1}  # the shared machine's event-loop waits: not under test


@pytest.mark.parametrize("name", ["blind-stall", "redis-password", "healthy-routes"])
def test_todays_scenarios_are_named_for_their_cause(name: str) -> None:
    sc = SCENARIOS[name]
    with Running(sc, scale=SCALE, thresholds=THRESHOLDS) as run:
        results = run.run(LOAD_S)
        report = run.report(LOAD_S)
        target = run.target()
    said = json.dumps(report["findings"], indent=1)
    assert found(report, sc, target), said
    assert wrong_classes(report, sc, target) == [], said
    assert all(r.ok > 0 for r in results) and sum(r.failed for r in results) == 0, results
    if sc.expect != "healthy":  # the cause is what the doctor says first
        first = report["findings"][0]
        assert (first["class"], first["pool"], first["replica"]) == (sc.expect, *target), said
        assert sc.says in first["summary"] + " " + first["action"], said
