"""Admin authentication under attack: tokens too short are refused at start; failed attempts
are throttled per client address (429 + Retry-After), logged, counted and audited; unknown
admin paths answer in OpenAI's error shape."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values
from tests.support.procs import KVGATE, ROOT, Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "guard-admin-token-0123456789"
FAILURES = "kvgate_admin_auth_failures_total"


def _shape(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_failed_admin_auth_is_throttled_logged_counted_and_audited(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(upstreams=[sim], auth=True, env=env)
    wrong = "wrong-token-" + "x" * 20
    with gw, admin_client(base, wrong) as attacker, admin_client(base, ADMIN) as admin:
        before = metric_values(base, FAILURES)  # every reason there from the start, at 0
        assert before == {f'{{reason="{r}"}}': 0.0
                          for r in ("missing", "invalid", "tenant_key", "disabled", "throttled")}
        # the path is the client's: 60,000 characters of it were kept in each audit entry
        _shape(attacker.get("/tenants/" + "x" * 60_000), 401)
        for _ in range(3):
            assert _shape(attacker.get("/tenants"), 401)["type"] == "AuthenticationError"
        entries = admin.get("/audit").json()["data"]
        failed = [e for e in entries if e["action"] == "admin.auth_failed"]
        assert len(failed) == 4 and {e["target"] for e in failed} == {"127.0.0.1"}
        assert failed[0]["detail"] == {"reason": "invalid", "path": "/admin/tenants"}
        long = "/admin/tenants/" + "x" * (256 - len("/admin/tenants/")) + "..."
        assert failed[-1]["detail"] == {"reason": "invalid", "path": long}
        for _ in range(6):  # ten failures in all: the address's budget
            _shape(attacker.get("/tenants"), 401)
        throttled = attacker.get("/tenants")
        assert _shape(throttled, 429)["type"] == "RateLimitError"
        assert int(throttled.headers["retry-after"]) >= 1
        assert admin.get("/tenants").status_code == 429  # the address, whatever the token
        counts = metric_values(base, FAILURES)
        assert counts['{reason="invalid"}'] == 10.0 and counts['{reason="throttled"}'] == 2.0
        assert httpx.get(f"{base}/healthz").status_code == 200  # only /admin is throttled
        log = gw.output()
        assert log.count("admin authentication failed") == 10 and "127.0.0.1" in log
        assert wrong not in log and ADMIN not in log


def test_unknown_admin_paths_and_methods_answer_in_openai_shape(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(upstreams=[sim], auth=True, env=env)
    with gw, admin_client(base, ADMIN) as admin:
        missing = _shape(admin.get("/no-such-thing"), 404)
        assert missing["type"] == "NotFoundError" and "/admin/no-such-thing" in str(
            missing["message"])
        assert "detail" not in admin.get("/no-such-thing").json()
        assert _shape(admin.put("/audit"), 405)["type"] == "MethodNotAllowedError"
        assert admin.put("/audit").headers["allow"] == "GET, HEAD"


def test_an_admin_token_shorter_than_16_characters_is_refused_at_start() -> None:
    for value in ("short-tok", "ops:0123456789abcdef,ci:tiny"):
        env = {"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": "", "KVGATE_ADMIN_TOKEN": value,
               "KVGATE_SALT_SECRET": AUTH_SECRET}
        cmd = [*KVGATE, "serve", "--upstream", "http://127.0.0.1:9", "--host", "127.0.0.1",
               "--port", str(free_port())]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30,
                                env=env)
        assert result.returncode == 2, result.stderr
        assert "admin tokens need at least 16" in result.stderr
        assert "Traceback" not in result.stderr
        assert "short-tok" not in result.stderr and "tiny" not in result.stderr.replace(
            "'ci'", "")


def test_an_address_gets_ten_failures_from_a_gateway_of_two_workers(
    sim_factory: SimFactory, redis_url: str,
) -> None:
    """Each worker throttled alone on a whole budget: an address made 20 failed attempts
    before its first 429 through a gateway of two workers (the kernel spreads its
    connections over both), where one process allows 10."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    gw, base = gateway_proc(upstreams=[sim], auth=True, env=env, args=["--workers", "2"])
    statuses: list[int] = []
    with gw:
        for _ in range(40):  # a new connection each: either worker may take it
            with admin_client(base, "wrong-token-" + "x" * 20) as attacker:
                statuses.append(attacker.get("/tenants").status_code)
        assert set(statuses) == {401, 429}, statuses
        assert statuses.count(401) <= 10, statuses
