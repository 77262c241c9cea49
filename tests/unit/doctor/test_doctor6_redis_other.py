"""A Redis refusal kvgate's cause gauges can only call `other` (a password in KVGATE_REDIS_URL
for a Redis without requirepass): the report's finding gets /readyz's words for it, on
recorded /readyz pages and report findings built by the real rule."""

from __future__ import annotations

import json

from gateway.doctor.process_rules import classify_gateway
from gateway.doctor.readiness import OTHER_ACTION, OTHER_WHAT, from_readyz
from gateway.doctor.redis_causes import REFUSED
from gateway.doctor.window import GatewayStats
from tests.unit.doctor.test_rules import CTX, TH

URL = "http://gw:8000"
NO_PASSWORD = ("server replied ERR: KVGATE_REDIS_URL gives a password, and this Redis has none "
               "for its default user (no requirepass): remove the password from the URL, or "
               "set requirepass on Redis")


def _sync_other() -> dict[str, object]:
    """The report's finding on a shared routing state refused with cause `other`."""
    g = GatewayStats(cpu_share=0.05, redis_up=1.0, tenancy_loaded=1.0, sync_degraded=1.0,
                     sync_degraded_s=5.0, sync_cause="other")
    (f,) = [f for f in classify_gateway(g, TH, CTX) if f.cls == "gateway"]
    return f.as_dict()


def _page(reason: str) -> bytes:
    return json.dumps({"status": "ready", "degraded": True, "pools": "ready",
                       "sync": {"degraded": True, "reason": reason}}).encode()


def test_the_readiness_words_track_the_other_refusal() -> None:
    assert REFUSED["other"] == (OTHER_WHAT, OTHER_ACTION)


def test_a_password_redis_does_not_want_is_named_with_its_change() -> None:
    f = _sync_other()
    assert from_readyz(URL, 200, _page(NO_PASSWORD), [f])["findings"] == []  # not twice
    assert "requirepass" in str(f["summary"]) and "log names" not in str(f["summary"])
    assert str(f["action"]).startswith("remove the password from KVGATE_REDIS_URL")
    evidence = f["evidence"]
    assert isinstance(evidence, list) and evidence[-1]["what"] == "sync.reason"


def test_another_refusal_quotes_readyz_masked() -> None:
    f = _sync_other()
    from_readyz(URL, 200, _page("server replied ERR unknown command 'XADD' for redis://u:pw@r"),
                [f])
    assert "unknown command 'XADD'" in str(f["summary"]) and ":pw@" not in json.dumps(f)
    assert OTHER_ACTION in str(f["action"])


def test_without_a_metric_finding_readyz_says_the_change() -> None:
    (f,) = from_readyz(URL, 200, _page(NO_PASSWORD), [])["findings"]
    assert "remove the password from KVGATE_REDIS_URL" in f["action"]
