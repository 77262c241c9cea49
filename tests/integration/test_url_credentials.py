"""Replica URLs may carry credentials (``http://user:password@host:port``); nothing kvgate
shows or logs repeats them: the admin API's replica list and policy document, /readyz, the
doctor, /metrics, the gateway's log, a 400 naming a bad URL and `kvgate config check` show
``http://***@host:port``; a policy document sent back as read keeps the stored credentials.
Real simulator, real gateway, over loopback."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

import httpx
import openai
import yaml

from tests.support.gateway import admin_client, gateway_proc, wait_for
from tests.support.procs import KVGATE, ROOT, Proc, free_port

ADMIN = "url-credentials-admin-0123456789"
SECRETS = ("s3cret-pw", "hunter2-pw", "tok3n-user")
SimFactory = Callable[..., tuple[Proc, str]]


def _with_userinfo(url: str, userinfo: str) -> str:
    return url.replace("http://", f"http://{userinfo}@")


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def test_replica_credentials_are_never_shown_or_logged(sim_factory: SimFactory) -> None:
    _, sim = sim_factory()
    live = _with_userinfo(sim, "alice:s3cret-pw")
    dead = f"http://bob:hunter2-pw@127.0.0.1:{free_port()}"  # nothing listens: found down
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": [live, dead]}},
              "models": {"m": {"default": "p"}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for _ in range(3):  # one of them may be the dead replica's try: logged, retried
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        wait_for(lambda: "not_ready" in httpx.get(f"{base}/readyz").text
                 or '"healthy":false' in admin.get("/replicas").text.replace(" ", ""),
                 what="the dead replica found down")
        replicas = admin.get("/replicas").json()["data"][0]["replicas"]
        shown = sorted(r["url"] for r in replicas)
        assert shown == sorted(["http://***@" + u.rpartition("@")[2] for u in (live, dead)])
        pages = [admin.get("/replicas").text, admin.get("/doctor").text,
                 httpx.get(f"{base}/readyz").text, httpx.get(f"{base}/metrics").text,
                 httpx.get(f"{base}/v1/models").text]
        assert not [_leaks(p) for p in pages if _leaks(p)]
        # a bad URL in a policy change is named in its 400 without its credentials
        bad = {**config, "pools": {"p": {"served_model": "sim-model",
                                         "replicas": [_with_userinfo(sim, "tok3n-user") + "/v1"]}}}
        resp = admin.put("/policy", json=bad)
        assert resp.status_code == 400 and "http://***@127.0.0.1:" in resp.text, resp.text
        assert not _leaks(resp.text)
        assert not _leaks(admin.get("/audit").text)
        # the policy document as read shows them hidden; sent back as read (PUT, PATCH), the
        # stored credentials stay: the replicas stay reachable, no new version for a no-op
        got = admin.get("/policy")
        assert not _leaks(got.text) and "http://***@127.0.0.1:" in got.text
        version = got.headers["etag"]
        resp = admin.patch("/policy", json={"pools": got.json()["pools"]})
        assert resp.status_code == 200 and resp.headers["etag"] == version, resp.text
        resp = admin.put("/policy", json=got.json())
        assert resp.status_code == 200 and not _leaks(resp.text), resp.text
        assert resp.headers["etag"] != version
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        shown_now = sorted(r["url"] for r in admin.get("/replicas").json()["data"][0]["replicas"])
        assert shown_now == shown
        # a hidden URL that matches no stored replica cannot be restored: a 400
        unknown = {**got.json(), "pools": {"p": {"served_model": "sim-model",
                                                 "replicas": ["http://***@10.9.9.9:8000"]}}}
        resp = admin.put("/policy", json=unknown)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "pools", resp.text
        gw.stop()  # its whole log, shutdown included
        assert not _leaks(gw.output(None))


def test_config_check_shows_replica_urls_without_credentials() -> None:
    config: dict[str, Any] = {"pools": {"p": {"served_model": "m",
                              "replicas": ["http://tok3n-user@10.0.0.1:8000",
                                           "https://alice:s3cret-pw@10.0.0.2:8443/"]}},
              "models": {"m": {"default": "p"}}}
    fd, path = tempfile.mkstemp(suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f)
        result = subprocess.run([*KVGATE, "config", "check", path], cwd=ROOT,
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, "KVGATE_CONFIG": ""})
        assert result.returncode == 0, result.stderr
        assert "http://***@10.0.0.1:8000" in result.stdout
        assert "https://***@10.0.0.2:8443" in result.stdout
        assert not _leaks(result.stdout + result.stderr)
        # the same for a URL refused by validation
        config["pools"] = {"p": {"served_model": "m",
                                 "replicas": ["http://alice:s3cret-pw@10.0.0.2:8000/v1"]}}
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        result = subprocess.run([*KVGATE, "config", "check", path], cwd=ROOT,
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, "KVGATE_CONFIG": ""})
        assert result.returncode != 0 and "http://***@10.0.0.2:8000/v1" in result.stderr
        assert not _leaks(result.stdout + result.stderr)
    finally:
        os.unlink(path)


def test_a_replica_url_urllib_cannot_parse_is_a_400_that_shows_no_credentials(
    sim_factory: SimFactory,
) -> None:
    """A replica URL with a bad port, or a password holding ``#`` or ``?`` (which end the
    authority, so urllib reads the password as a port), is refused by a 400 naming the pool,
    not a 500 (`replica_id` raised a bare ValueError) whose log line repeated what urllib took
    for a port -- the password; `shown_url` hides such userinfo too."""
    _, sim = sim_factory()
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": [sim]}},
              "models": {"m": {"default": "p"}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        for url in ("http://alice:s3cret-pw#x@127.0.0.1:9", "http://alice:s3cret-pw?x@127.0.0.1:9",
                    "http://127.0.0.1:99999"):
            bad = {**config, "pools": {"p": {"served_model": "sim-model", "replicas": [url]}}}
            resp = admin.put("/policy", json=bad)
            assert resp.status_code == 400, (url, resp.text)
            assert resp.json()["error"]["param"].startswith("pools"), resp.text
            assert not _leaks(resp.text), resp.text
        gw.stop()
        assert not _leaks(gw.output(None))
