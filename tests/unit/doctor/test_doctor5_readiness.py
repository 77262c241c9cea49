"""/readyz's answer as the doctor's findings (`gateway.doctor.readiness`): each degraded
reason named once, what the report already names from its metrics not said twice, a password
in a reason masked, an answer that is not kvgate's JSON a finding of its own."""

from __future__ import annotations

import json
from typing import Any

from gateway.doctor.readiness import from_readyz, merge

URL = "http://gw:8000"
REDIS_DOWN = {"severity": "warning", "class": "gateway", "pool": None, "replica": None,
              "summary": "Redis degraded", "action": "restore Redis",
              "evidence": [{"metric": "kvgate_redis_up", "what": "up", "value": 0.0}]}


def _page(**fields: Any) -> bytes:
    return json.dumps({"status": "ready", "degraded": True, "pools": "ready", **fields}).encode()


def test_a_store_outage_the_report_names_is_not_said_twice() -> None:
    body = _page(tenancy={"degraded": True, "reason": "store unreachable"},
                 sync={"degraded": True, "reason": "unreachable"})
    sync_down = {**REDIS_DOWN, "evidence": [{"metric": "kvgate_sync_up", "what": "up"}]}
    assert from_readyz(URL, 200, body, [REDIS_DOWN, sync_down])["findings"] == []
    alone = from_readyz(URL, 200, body, [])["findings"]  # no metric finding: said from here
    assert [f["evidence"][0]["what"] for f in alone] == ["tenancy.reason", "sync.reason"]


def test_a_password_in_a_reason_is_masked_and_pools_are_named() -> None:
    body = _page(tenancy={"degraded": True,
                          "reason": "store unreachable: redis://u:hunter2@r:6379 refused"},
                 not_ready={"p": "no usable replica (10.0.0.1:8000: cannot connect)"})
    said = json.dumps(from_readyz(URL, 200, body, []))
    assert "hunter2" not in said and "redis://***@r:6379" in said
    found = from_readyz(URL, 200, body, [])["findings"]
    assert found[0]["class"] == "down" and found[0]["pool"] == "p"
    assert found[0]["severity"] == "critical"


def test_not_kvgates_json_is_a_finding_and_merge_keeps_the_worst_first() -> None:
    page = from_readyz(URL, 200, b"<html>secret</html>", [])
    (finding,) = page["findings"]
    assert "secret" not in json.dumps(page) and finding["severity"] == "warning"
    report: dict[str, Any] = {"worst": "ok", "findings": [
        {"severity": "ok", "class": "healthy", "evidence": []}], "readiness": None}
    merge(report, page)
    assert report["worst"] == "warning" and report["findings"][0] is finding
    assert report["readiness"] is page


def test_a_wiped_store_is_critical_and_an_unknown_reason_is_said_as_is() -> None:
    wiped = _page(tenancy={"degraded": True, "reason": "the store was wiped 12 s ago: ..."})
    (finding,) = from_readyz(URL, 200, wiped, [])["findings"]
    assert finding["severity"] == "critical" and "re-issue" in finding["action"]
    odd = _page(tenancy={"degraded": True, "reason": "a reason from a newer kvgate"})
    (finding,) = from_readyz(URL, 200, odd, [])["findings"]
    assert "a reason from a newer kvgate" in finding["summary"]
    ready = _page(degraded=False)
    assert from_readyz(URL, 200, ready, [])["findings"] == []


def test_every_reason_readyz_names_is_a_finding() -> None:
    """/readyz joins every tenancy reason that holds with '; ': the doctor turned only the
    first it knew into a finding (an evicting Redis hid gateways with other salt secrets)."""
    reason = ("Redis evicts any key when full (maxmemory-policy allkeys-lru); 1 other salt "
              "secret(s) in use on this Redis: a gateway started with another; the salt "
              "secret check cannot run: kv:salt_secrets is a string, not a hash")
    found = from_readyz(URL, 200, _page(tenancy={"degraded": True, "reason": reason}),
                        [])["findings"]
    assert len(found) == 3, found
    said = " | ".join(f["summary"] + " / " + f["action"] for f in found)
    assert "maxmemory-policy allkeys-lru" in said and "same salt secret" in said
    assert "delete the key kv:salt_secrets" in said
