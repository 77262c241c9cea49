"""What the doctor says of a Redis that answers but refuses kvgate's commands, per cause
(`redis_conn.CAUSE_LABELS`, exported as ``kvgate_redis_down_cause`` and
``kvgate_sync_down_cause``). Such a Redis runs: "restore Redis" sends an operator looking for
a dead server, so each refusal names what Redis said and the change that ends it. A Redis that
does not answer (``unreachable``, ``timeout``) keeps the words of an outage.
"""

from __future__ import annotations

from gateway.doctor.findings import Evidence, cite

__all__ = ["REFUSED", "cause_evidence", "refusal"]

# cause -> (what Redis does, the change that ends it)
REFUSED: dict[str, tuple[str, str]] = {
    "oom": (
        "Redis refuses kvgate's writes: it is out of memory (OOM: maxmemory reached under "
        "maxmemory-policy noeviction)",
        "raise Redis's maxmemory, or give kvgate a Redis of its own; a volatile-* "
        "maxmemory-policy evicts only keys with a TTL (kvgate's rate-limit windows and "
        "Responses API ids), never kvgate's tenants, API keys or policy (allkeys-* would)"),
    "wrongtype": (
        "Redis refuses kvgate's commands on a key of kvgate's that holds another type "
        "(WRONGTYPE): something else wrote under tenancy.namespace",
        "delete the key the gateway's log names (\"<key> is a <type>, not a <type>\"; kvgate "
        "makes it again; a generation counter that \"is not an integer\": set it as the log "
        "says) and keep other writers off tenancy.namespace"),
    "noperm": (
        "Redis refuses kvgate's commands: the ACL user in KVGATE_REDIS_URL lacks a permission "
        "kvgate needs (NOPERM)",
        "grant that ACL user the commands and keys kvgate uses (Redis's ACL LOG names the "
        "ones refused; ACL SETUSER), or name another user in KVGATE_REDIS_URL"),
    "auth": (
        "Redis refuses kvgate's credentials (WRONGPASS or NOAUTH: a wrong or missing user "
        "name or password)",
        "fix the user name and password in KVGATE_REDIS_URL (redis://user:password@host:port) "
        "or the ACL user's password in Redis (ACL SETUSER)"),
    "loading": (
        "Redis is loading its dataset into memory (LOADING) and runs no command until it "
        "ends",
        "wait: the load takes longer the larger Redis's RDB or AOF file; kvgate resumes on "
        "its own"),
    "readonly": (
        "Redis refuses kvgate's writes: KVGATE_REDIS_URL names a read-only replica "
        "(READONLY; after a failover, the old primary)",
        "point KVGATE_REDIS_URL at the primary"),
    "misconf": (
        "Redis refuses writes: it cannot save its data to disk (MISCONF, "
        "stop-writes-on-bgsave-error)",
        "fix Redis's persistence (disk space, the permissions of its dir: Redis's own log "
        "says why)"),
    "dbindex": (
        "Redis refuses kvgate's connection: the database number at the end of "
        "KVGATE_REDIS_URL (redis://host:port/N) is past the server's `databases` (16 by "
        "default; ERR DB index is out of range)",
        "use a database number below Redis's `databases` in KVGATE_REDIS_URL (or raise "
        "`databases` in redis.conf)"),
    "protected": (
        "Redis refuses kvgate's connection: it runs in protected mode (DENIED: no password "
        "set, so it takes connections from its own loopback only)",
        "give Redis a password (requirepass, or an ACL user) and put it in KVGATE_REDIS_URL"),
    "notredis": (
        "the address in KVGATE_REDIS_URL answers, but not as Redis: its answer is not Redis's "
        "protocol (another service listens at that port)",
        "point KVGATE_REDIS_URL at Redis's host and port"),
    "other": (
        "Redis refuses kvgate's commands (the gateway's log names its reply: \"server replied "
        "...\")",
        "read Redis's reply in the gateway's log and fix what it names"),
}


def refusal(cause: str | None) -> tuple[str, str] | None:
    """(what, action) of a Redis that refuses; None for one that does not answer."""
    return None if cause is None else REFUSED.get(cause)


def cause_evidence(metric: str, cause: str | None, now: bool) -> list[Evidence]:
    """The cause as evidence: the series of ``metric`` (an enum gauge) that reads 1."""
    if cause is None:
        return []
    return [cite(f'{metric}{{cause="{cause}"}}',
                 "cause (last sample)" if now else "cause (last seen in the window)", 1.0)]
