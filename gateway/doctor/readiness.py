"""What the gateway's own ``/readyz`` says, as the doctor's findings.

The report of ``GET /admin/doctor`` is built from the numbers the gateway samples (metrics,
replica state); the reasons ``/readyz`` gives for being degraded are strings it never samples:
a Redis that evicts any key when full, a key of another type at ``<ns>:salt_secrets``,
gateways with different salt secrets, a wiped store, unreadable records, a pool that cannot
serve. An operator saw ``"degraded": true`` there and a doctor that said nothing of it. So
`kvgate doctor` reads ``/readyz`` too (no token: it is a public page) and turns each reason
into a finding with its severity, what it means and the one change that ends it. A
``/readyz`` that cannot be read, or answers something that is not kvgate's JSON, is a
finding itself. Its body is never echoed (a proxy's page may hold anything), and a reason is
shown with any ``user:password@`` in it masked.

Stdlib only, like `render`: the CLI imports it and nothing of the gateway.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["from_readyz", "merge", "unread"]

METRIC = "/readyz"
_USERINFO = re.compile(r"(://)[^/@\s]*@")
# reasons the report already names from kvgate_redis_up / kvgate_sync_up (its Redis and
# shared-state findings): not said twice
_STORE_DOWN = ("store unreachable", "store refuses kvgate's commands", "not loaded yet",
               "rate limits are per-process")
_ORDER = ("critical", "warning", "info", "ok")

# (a phrase of the tenancy reason, severity, what it means, the action): a finding per
# phrase found
_TENANCY: tuple[tuple[str, str, str, str], ...] = (
    ("evicts any key", "warning",
     "Redis evicts any key when it is full{policy}: kvgate's tenants, API keys, policy and "
     "concurrency leases may vanish (each eviction of its bootstrap marker is a wipe)",
     "set maxmemory-policy noeviction on that Redis (CONFIG SET maxmemory-policy noeviction, "
     "and in its redis.conf), with maxmemory above kvgate's needs; or give kvgate a Redis of "
     "its own"),
    ("salt secret check cannot run", "warning",
     "the check that every gateway on this Redis uses the same salt secret cannot run: a key "
     "of another type holds its place, so gateways with different secrets would not be told",
     "delete the key {key} (kvgate writes it again as a hash; keep other writers off "
     "tenancy.namespace)"),
    ("other salt secret", "warning",
     "gateways on this Redis derive cache salts from different secrets: each tenant gets "
     "another cache_salt behind each, so its cache is split between them",
     "give every gateway the same salt secret (KVGATE_SALT_SECRET) and tenancy.salt_encoding; "
     "it clears within 60 s of the odd gateway's restart"),
    ("was wiped", "critical",
     "the tenancy store was wiped and not restored: API keys and tenants made through the "
     "admin API are gone, their clients get 401",
     "re-issue those keys and tenants (or restore Redis from a backup); run Redis with "
     "persistence (appendonly yes)"),
    ("went back from generation", "warning",
     "the tenancy store went back to an older snapshot: keys revoked since work again, keys "
     "made since are gone",
     "revoke and issue again the keys the gateway's log names; run Redis with appendonly yes"),
    ("unreadable record", "warning",
     "records in the tenancy store could not be read and are skipped (those tenants or keys "
     "are refused); every other one is served",
     "fix or delete the records named (a rolling upgrade: replace the older gateways)"),
    ("store data unreadable", "warning",
     "the tenancy store's data could not be read: the gateway serves its last known state",
     "read the gateway's log for the error; a rolling upgrade: finish it"),
    ("store is empty", "warning",
     "the tenancy store answered empty: the gateway serves its last known state",
     "check whether Redis was reset; kvgate writes its state back on its own"),
    ("store refuses writes", "warning",
     "Redis refuses kvgate's writes: keys and policy are served, admin writes fail, rate "
     "limits are per process",
     "give Redis room (maxmemory) when it is out of memory, or point KVGATE_REDIS_URL at the "
     "primary when it is a read-only replica"),
)


def _masked(text: str) -> str:
    return _USERINFO.sub(r"\1***@", text)


def _finding(severity: str, summary: str, action: str, what: str, note: str,
             cls: str = "gateway", pool: str | None = None) -> dict[str, Any]:
    """A finding as the report holds one (`Finding.as_dict`), its evidence what /readyz said."""
    return {"severity": severity, "pool": pool, "replica": None, "summary": summary,
            "action": action,
            "evidence": [{"metric": METRIC, "what": what, "value": None, "op": "",
                          "threshold": None, "threshold_name": None, "unit": "",
                          "note": _masked(note)}],
            "class": cls}


def unread(url: str, why: str) -> dict[str, Any]:
    """The readiness section of a /readyz that could not be read (one finding saying why)."""
    return {"url": f"{url}/readyz", "http_status": None, "status": None, "degraded": None,
            "findings": [_finding(
                "warning", f"/readyz could not be read: {_masked(why)}; its degraded reasons "
                "(Redis, tenancy, shared routing state, pools) are not in this report",
                "check that --url reaches the gateway itself (a proxy in front may not pass "
                "/readyz) and read its /readyz", "readiness", why)]}


def from_readyz(url: str, status: int, body: bytes,
                report_findings: list[dict[str, Any]]) -> dict[str, Any]:
    """The readiness section: what /readyz said, and a finding per degraded reason that the
    report (``report_findings``) does not already name; a report finding on a Redis refusal
    it could only call `other` gets /readyz's words for it (changed in place)."""
    try:
        page = json.loads(body)
    except ValueError:
        page = None
    if not isinstance(page, dict) or not isinstance(page.get("degraded"), bool):
        return unread(url, f"HTTP {status}, not kvgate's readiness JSON")
    cited = {e.get("metric") for f in report_findings
             if isinstance(f, dict) and f.get("class") != "healthy"
             for e in f.get("evidence") or [] if isinstance(e, dict)}
    _explain_other(report_findings, page)
    found = [*_not_ready(page, status), *_pools(page), *_tenancy(page, cited),
             *_sync(page, cited)]
    if page["degraded"] and not found and not cited & {"kvgate_redis_up", "kvgate_sync_up"}:
        found.append(_finding("warning", "the gateway says it is degraded (/readyz) without a "
                              "reason the doctor knows", "read /readyz and the gateway's log",
                              "degraded", "true"))
    return {"url": f"{url}/readyz", "http_status": status, "status": page.get("status"),
            "degraded": page["degraded"], "findings": found}


# A Redis refusal the report can only call `other` (its cause gauge has no label for it):
# `redis_causes.REFUSED["other"]`'s words send the operator to the log, while /readyz's reason
# holds Redis's reply and, for those kvgate knows, the change (a unit test keeps these in step)
OTHER_WHAT = ("Redis refuses kvgate's commands (the gateway's log names its reply: \"server "
              "replied ...\")")
OTHER_ACTION = "read Redis's reply in the gateway's log and fix what it names"
_OTHER_CAUSES = {'kvgate_redis_down_cause{cause="other"}': "tenancy",
                 'kvgate_sync_down_cause{cause="other"}': "sync"}
# (a phrase of the reason, what Redis does, the change)
_KNOWN_OTHER: tuple[tuple[str, str, str], ...] = (
    ("has none for its default user",
     "Redis refuses kvgate's password: KVGATE_REDIS_URL gives one and this Redis has none "
     "(no requirepass; AUTH answered \"called without any password configured\")",
     "remove the password from KVGATE_REDIS_URL, or set requirepass on Redis to it"),
)


def _explain_other(findings: list[dict[str, Any]], page: dict[str, Any]) -> None:
    """Give a report finding whose Redis cause is `other` what /readyz says of it (in place)."""
    for f in findings:
        if not isinstance(f, dict) or not isinstance(f.get("evidence"), list):
            continue
        part = next((_OTHER_CAUSES[str(e.get("metric"))] for e in f["evidence"]
                     if isinstance(e, dict) and e.get("metric") in _OTHER_CAUSES), None)
        section = page.get(part) if part else None
        reason = str(section.get("reason") or "") if isinstance(section, dict) else ""
        if not reason or OTHER_WHAT not in str(f.get("summary")):
            continue
        what, action = next(((w, a) for phrase, w, a in _KNOWN_OTHER if phrase in reason),
                            (f"Redis refuses kvgate's commands (/readyz {part}.reason: "
                             f"{_masked(reason)})", OTHER_ACTION))
        f["summary"] = str(f["summary"]).replace(OTHER_WHAT, what)
        f["action"] = str(f.get("action")).replace(OTHER_ACTION, action)
        f["evidence"].append(_finding("", "", "", f"{part}.reason", reason)["evidence"][0])


def _not_ready(page: dict[str, Any], status: int) -> list[dict[str, Any]]:
    if status == 200 and page.get("status") == "ready":
        return []
    return [_finding("critical", f"the gateway is not ready (/readyz answered {status}): its "
                     "Service sends it no traffic", "make a pool servable and tenancy state "
                     "loaded (the findings below say which)", "status",
                     str(page.get("status")))]


def _pools(page: dict[str, Any]) -> list[dict[str, Any]]:
    pools = page.get("not_ready")
    if not isinstance(pools, dict):
        return []
    return [_finding("critical", f"pool {name} cannot serve: {_masked(str(why))}; its "
                     "requests get 503", "bring a replica of the pool back (the replica "
                     "findings say why each is out)", f"not_ready.{name}", str(why),
                     cls="down", pool=str(name))
            for name, why in pools.items()]


def _tenancy(page: dict[str, Any], cited: set[Any]) -> list[dict[str, Any]]:
    tenancy = page.get("tenancy")
    if not isinstance(tenancy, dict) or not tenancy.get("degraded"):
        return []
    reason = str(tenancy.get("reason") or "")
    if "kvgate_redis_up" in cited and reason.startswith(_STORE_DOWN):
        return []  # the report's Redis finding says it, with its cause and fix
    # /readyz names every reason that holds, '; '-joined: a finding for each one known
    found = [_finding(severity, meaning.format(policy=_policy(reason)),
                      action.format(key=_masked(_key_after(reason, phrase))),
                      "tenancy.reason", reason)
             for phrase, severity, meaning, action in _TENANCY if phrase in reason]
    if found:
        return found
    return [_finding("warning", f"tenancy degraded: {_masked(reason or 'no reason given')}",
                     "read /readyz and the gateway's log for this reason",
                     "tenancy.reason", reason)]


def _key_after(reason: str, phrase: str) -> str:
    """The key a reason names after its phrase (``...cannot run: KEY is a string...``)."""
    return reason[reason.index(phrase):].split(": ", 1)[-1].split(" is ", 1)[0]


def _policy(reason: str) -> str:
    """The eviction policy a reason names, for the summary (`` (maxmemory-policy X)``)."""
    found = re.search(r"maxmemory-policy [\w-]+", reason)
    return f" ({found.group(0)})" if found else ""


def _sync(page: dict[str, Any], cited: set[Any]) -> list[dict[str, Any]]:
    sync = page.get("sync")
    if not isinstance(sync, dict) or not sync.get("degraded") or "kvgate_sync_up" in cited:
        return []
    cause = str(sync.get("reason") or "unknown")
    action = next((a for phrase, _, a in _KNOWN_OTHER if phrase in cause),
                  "restore Redis (KVGATE_REDIS_URL)")
    return [_finding("warning", "shared routing state degraded: this gateway routes on its "
                     f"own state (/readyz sync.reason: {_masked(cause)})",
                     f"{action}; sharing resumes on its own", "sync.reason", cause)]


def merge(report: dict[str, Any], readiness: dict[str, Any]) -> None:
    """Put the readiness section and its findings into ``report``: worst first, `worst` too."""
    report["readiness"] = readiness
    if not isinstance(report.get("findings"), list):
        return  # (not a report the renderers read either: said as such by the CLI)
    found = [*readiness["findings"], *report["findings"]]
    found.sort(key=lambda f: _ORDER.index(f.get("severity")) if isinstance(f, dict)
               and f.get("severity") in _ORDER else len(_ORDER))
    report["findings"] = found
    if readiness["findings"]:
        report["worst"] = found[0].get("severity")
