"""`kvgate doctor` on faults its classes did not name: a replica serving another model, and
a pool whose replicas refuse the traffic's prompts as longer than their context length.

Both were seen live (`loadtest/doctor_scenarios.py`: ``wrong-model``, ``context-too-long``):
the first was named down with "its health checks or requests failing" and "check its vLLM
process (GET /health)" -- its /health answers 200, kvgate took it out for serving another
model, which it knew; the second, every request answered vLLM's 400, was reported healthy
everywhere (its replicas idle, the pool's 5xx 0).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from loadtest.doctor_scenarios import SCENARIOS, Running, found, wrong_classes

pytestmark = pytest.mark.slow

SCALE = 20.0
LOAD_S = 5.0
THRESHOLDS = {"overhead_p99_s": 0.1}  # the shared machine's event-loop waits: not under test


def _diagnose(name: str) -> tuple[dict[str, Any], Running]:
    sc = SCENARIOS[name]
    with Running(sc, scale=SCALE, thresholds=THRESHOLDS) as run:
        results = run.run(LOAD_S)
        report = run.report(LOAD_S)
    said = json.dumps({k: report[k] for k in ("findings", "replicas", "pools")}, indent=1)
    target = run.target()
    assert found(report, sc, target), said
    assert wrong_classes(report, sc, target) == [], said
    assert results[-1].ok > 0 and results[-1].failed == 0  # the control pool served
    return report, run


def test_a_replica_serving_another_model_is_named_for_it() -> None:
    report, run = _diagnose("wrong-model")
    pool, rid = run.target()
    (down,) = [f for f in report["findings"] if (f["pool"], f["replica"]) == (pool, rid)]
    assert "serves model 'm-other', not the pool's 'm-p'" in down["summary"], down
    assert "--served-model-name" in down["action"] and "GET /health" not in down["action"]
    (row,) = [r for r in report["replicas"] if r["id"] == rid]
    assert row["reason"].startswith("serves model")


def test_prompts_past_the_context_length_are_named_with_it() -> None:
    report, _ = _diagnose("context-too-long")
    (f,) = [f for f in report["findings"] if (f["pool"], f["replica"]) == ("p", None)]
    assert (f["class"], f["severity"]) == ("errors", "critical"), f
    assert "refused by its replicas with a 4xx" in f["summary"]
    assert "--max-model-len: 1,024 tokens" in f["summary"] and "--max-model-len" in f["action"]
    share = f["evidence"][0]
    assert (share["threshold_name"], share["value"]) == ("refused_share", 1.0)
    length = next(e for e in f["evidence"] if e["metric"] == "vllm /v1/models max_model_len")
    assert length["value"] == 1024
    (pool,) = [p for p in report["pools"] if p["name"] == "p"]
    assert pool["refused"] == pool["requests"] > 0
