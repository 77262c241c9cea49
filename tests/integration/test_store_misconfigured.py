"""A `KVGATE_REDIS_URL` an operator got wrong, on a real redis-server with a password and an
ACL user: /readyz and the log say what is wrong -- the credentials, the ACL (naming the command
refused), the database number -- never the password, and the log says it once. /readyz said
"store unreachable" and the log "cannot reach Redis at ... (server replied WRONGPASS)", which
sent operators to the network; an ACL user that may SUBSCRIBE but not run kvgate's scripts was
logged as "answers again" after each refusal."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc
from tests.support.redis_acl import password_redis

PASSWORD = "misconf-pass-Qx73"  # tests only
WRONG = "not-the-pass-Lk52"  # tests only
ADMIN = "misconf-admin-token-0123456789"


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    """A redis-server with a password, and an ACL user ``reader`` (password ``r-pw``) that may
    read and subscribe but not write nor run scripts."""
    with password_redis(PASSWORD, "r-pw") as port:
        yield port


def _gateway(url: str) -> tuple[Proc, str]:
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url}
    return gateway_proc(config=config, env=env, auth=True, ready=False)


def _store_lines(gw: Proc) -> list[str]:
    """The messages of the tenancy store's log lines about Redis."""
    out = []
    for line in gw.output(tail=None).splitlines():
        if line.startswith("{"):
            doc = orjson.loads(line)
            if doc["logger"] == "gateway.tenancy.reachability":
                out.append(doc["msg"])
    return out


@pytest.mark.parametrize(("userinfo", "db", "said"), [
    (f":{WRONG}@", 0, "WRONGPASS: authentication failed (the user name or password in "
                      "KVGATE_REDIS_URL is wrong"),
    ("", 0, "NOAUTH: authentication required (Redis has a password; KVGATE_REDIS_URL gives "
            "none)"),
    ("reader:r-pw@", 0, "NOPERM: the ACL user of KVGATE_REDIS_URL may not run EVALSHA"),
    (f":{PASSWORD}@", 99, "ERR: DB index is out of range (the database number at the end of "
                          "KVGATE_REDIS_URL"),
], ids=["wrong-password", "no-password", "acl-user", "db-index"])
def test_what_is_wrong_is_said_in_readyz_and_once_in_the_log(
    redis_port: int, userinfo: str, db: int, said: str,
) -> None:
    gw, base = _gateway(f"redis://{userinfo}127.0.0.1:{redis_port}/{db}")
    with gw:
        def reason() -> str:
            body = httpx.get(f"{base}/readyz", timeout=5).json()
            # (a /readyz read as the gateway starts may say nothing of the store yet)
            return str(body.get("tenancy", {}).get("reason"))

        wait_for(lambda: said in reason(), timeout=20, what=f"/readyz naming {said!r}")
        ready = httpx.get(f"{base}/readyz", timeout=5)
        assert ready.status_code == 503  # nothing loaded: no key can be checked
        doc = ready.json()
        assert doc["tenancy"]["reason"].startswith("store refuses kvgate's commands: ")
        assert "unreachable" not in doc["tenancy"]["reason"]
        assert said in doc["sync"]["reason"] or "NOPERM" in doc["sync"]["reason"], doc
        time.sleep(5)  # the store was retried (every 2 s) and /readyz read meanwhile
        for _ in range(20):
            httpx.get(f"{base}/readyz", timeout=5)
        lines = _store_lines(gw)
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"refused by Redis at 127.0.0.1:{redis_port} (server "
                                   f"replied {said}"), lines
        assert not any("answers again" in line for line in lines), lines
        gw.stop()
        output = gw.output(tail=None)
    for secret in (PASSWORD, WRONG, "r-pw"):
        assert secret not in output
        assert secret not in ready.text


def test_rediss_at_a_plain_port_is_named_in_readyz_as_in_the_log() -> None:
    """/readyz said "store unreachable: timed out" where the log said what to change."""
    plain, url = redis_proc()
    gw, base = _gateway(url.replace("redis://", f"rediss://:{PASSWORD}@"))
    hint = "in the TLS handshake? KVGATE_REDIS_URL is rediss://"
    with plain, gw:
        def reason() -> str:
            return str(httpx.get(f"{base}/readyz", timeout=5).json()["tenancy"]["reason"])

        wait_for(lambda: reason() != "None", timeout=20, what="/readyz degraded")
        assert reason().startswith(f"store unreachable: timed out {hint}"), reason()
        assert PASSWORD not in gw.output(tail=None)
