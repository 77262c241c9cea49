"""What `bench_soak` reads of the process under test: its RSS, descriptors and sockets from
/proc, the probe's counts (`loadtest.soak_probe`), its /metrics and /admin/replicas."""

from __future__ import annotations

import os
import re
from typing import Any

import httpx
import orjson

__all__ = ["ADMIN", "counted", "grown", "grown_types", "sample"]

ADMIN = "soak-admin-token-0123456789"  # a throwaway process's admin token, loopback only


def _tcp() -> dict[str, tuple[int, int, str]]:
    """Socket inode -> (local port, remote port, state) of every TCP socket on the machine."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    out[cols[9]] = (int(cols[1].rsplit(":", 1)[1], 16),
                                    int(cols[2].rsplit(":", 1)[1], 16), cols[3])
        except OSError:
            continue
    return out


def _socket_inodes(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.append(link[8:-1])
    return out


def sample(pid: int, base: str | None, probe: str | None,
           upstream_ports: frozenset[int] = frozenset(), port: int = -1) -> dict[str, Any]:
    """RSS (MiB), open descriptors, its TCP sockets (from clients, to replicas, other: Redis),
    CLOSE_WAIT ones, live tasks, /metrics lines of `pid`."""
    with open(f"/proc/{pid}/status") as f:
        rss = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024  # type: ignore[union-attr]
    tcp = _tcp()
    if port < 0 and base:  # the port clients connect to (the picker's: its gRPC port)
        port = int(base.rsplit(":", 1)[1])
    socks = [tcp[i] for i in _socket_inodes(pid) if i in tcp]
    row: dict[str, Any] = {
        "rss_mib": round(rss, 1), "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "clients": sum(1 for lp, _, st in socks if lp == port and st != "0A"),
        "to_replicas": sum(1 for _, rp, _ in socks if rp in upstream_ports),
        "to_other": sum(1 for lp, rp, st in socks
                        if lp != port and rp not in upstream_ports and st != "0A"),
        "close_wait": sum(1 for _, _, st in socks if st == "08"),
    }
    if probe is not None and os.path.exists(probe):
        with open(probe, "rb") as f:
            doc = orjson.loads(f.read())
        row["tasks"] = doc["tasks"]
        row["live"], row["waiting"] = doc["live"], doc["waiting"]
        row["malloc_mib"], row["gc_objects"] = doc.get("malloc_mib"), doc.get("gc_objects")
        if doc.get("types"):
            row["types"] = doc["types"]
        if doc.get("holders"):
            row["holders"] = doc["holders"]
        if doc.get("top"):
            row["top"] = doc["top"]
    if base is not None:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        fams: dict[str, int] = {}
        for ln in text.splitlines():
            if ln and ln[0] != "#":
                name = re.split(r"[{ ]", ln, maxsplit=1)[0]
                fams[name] = fams.get(name, 0) + 1
        row["metric_lines"] = sum(fams.values())
        row["families"] = fams
    return row


def counted(base: str) -> dict[str, float]:
    """What must be 0 once the load stops: in flight (metrics, admin view), queued."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in ("kvgate_inflight_requests", "kvgate_flow_queue_depth"):
        vals = re.findall(rf"^{fam}\{{[^}}]*\}} (\S+)$", text, re.M)
        out[fam] = sum(float(v) for v in vals)
    r = httpx.get(f"{base}/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"},
                  timeout=30).json()
    for fam in ("kvgate_flow_queued_total", "kvgate_flow_abandoned_total",
                "kvgate_flow_shed_total", "kvgate_unread_answers_total"):  # the load reached them
        vals = re.findall(rf"^{fam}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        out[fam] = sum(float(v) for v in vals)
    out["admin_in_flight"] = _walk(r, ("in_flight", "inflight"))
    out["admin_queued"] = _walk(r, ("queued", "depth"))
    return out


def _walk(doc: Any, names: tuple[str, ...]) -> float:
    """The sum of every number under one of `names`, anywhere in `doc`."""
    if isinstance(doc, dict):
        return sum(float(v) if k in names and isinstance(v, (int, float)) else _walk(v, names)
                   for k, v in doc.items())
    if isinstance(doc, list):
        return sum(_walk(v, names) for v in doc)
    return 0.0


def grown(first: dict[str, Any], last: dict[str, Any]) -> dict[str, str]:
    """The /metrics families with more series in `last` than in `first`."""
    a, b = first.get("families", {}), last.get("families", {})
    return {k: f"{a.get(k, 0)} -> {n}" for k, n in sorted(b.items()) if n > a.get(k, 0)}


def grown_types(rows: list[dict[str, Any]], last: dict[str, Any]) -> dict[str, str]:
    """The object types with over 10 % (and 200) more live objects at the end than in the
    first count under load."""
    first: dict[str, int] = next((r["types"] for r in rows if r.get("types")), {})
    b = last.get("types", {})
    return {k: f"{first.get(k, 0)} -> {n}" for k, n in sorted(b.items())
            if n > 1.1 * first.get(k, 0) + 200}
