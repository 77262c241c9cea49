"""A bare `KVGATE_ADMIN_TOKEN` holding a ':' is refused at start, saying why and showing no
part of it. It was read as ``id:token``: the part before the ':' became the id the audit log
shows (a piece of the secret, in every entry), the rest the token, and the whole value the
operator had was a 401. A lone ``id:token`` whose id is a name still works (its id is not
shown in a refusal: it may be a secret's first part). A real `kvgate serve`.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import KVGATE, ROOT, free_port

SECRET_PARTS = ("p@ss", "w0rd-0123456789abcdef", "ops", "tail-0123456789abcdef", "sh0rt")


def _serve(value: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": "", "KVGATE_ADMIN_TOKEN": value,
           "KVGATE_SALT_SECRET": AUTH_SECRET}
    cmd = [*KVGATE, "serve", "--upstream", "http://127.0.0.1:9", "--host", "127.0.0.1",
           "--port", str(free_port())]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("value", ["p@ss:w0rd-0123456789abcdef",  # no id before the ':'
                                   "ops:ab:tail-0123456789abcdef"])  # a ':' in the token
def test_a_token_with_a_colon_is_refused_at_start_unshown(value: str) -> None:
    result = _serve(value)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "an admin token cannot contain ':'" in result.stderr
    assert "Traceback" not in result.stderr
    said = result.stderr.replace("'id:token,id:token'", "")
    for part in (*SECRET_PARTS, *value.split(":")):
        assert part not in said, part


def test_a_short_lone_pair_is_refused_without_its_id() -> None:
    result = _serve("sh0rt:0123")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the admin token has 4 characters" in result.stderr
    assert "sh0rt" not in result.stderr and "0123" not in result.stderr.replace("01234", "")


def test_a_lone_pair_still_names_its_writer() -> None:
    token = "lone-pair-token-0123456789abcdef"
    gw, base = gateway_proc(
        config={"pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
                "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}},
        env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": f"ops:{token}"},
        auth=True, ready=False)
    with gw, admin_client(base, token) as admin:
        assert admin.post("/tenants", json={"id": "t", "tier": "free"}).status_code == 201
        assert admin.get("/audit").json()["data"][0]["who"] == "ops"
