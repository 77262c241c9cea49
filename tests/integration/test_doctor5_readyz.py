"""`kvgate doctor` says what the gateway's /readyz says: each degraded reason a finding, with
its severity, what it means and the change that ends it. It read metrics only, so a gateway
answering ``"degraded": true`` (a Redis that evicts any key, a string at
``<ns>:salt_secrets``, gateways with different salt secrets) got a doctor's report with
nothing of it. A /readyz that cannot be read, or is not kvgate's JSON, is a finding too, never
a traceback. Real gateways, a real redis-server, real simulators, the CLI as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import redis

from tests.support.gateway import AUTH_SECRET, acme_gateway, gateway_proc
from tests.support.procs import ROOT, Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "doctor5-readyz-admin-token-0123456789"  # tests only
OTHER_SECRET = "doctor5-other-salt-secret-fedcba98"  # tests only


def _doctor(base: str, *args: str, status: int = 0) -> str:
    env = {"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": ADMIN}
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--url", base,
                           "--window", "30s", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == status, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    for secret in (AUTH_SECRET, OTHER_SECRET, ADMIN):
        assert secret not in done.stdout + done.stderr
    return done.stdout


def _readyz_findings(base: str) -> list[dict[str, Any]]:
    report = json.loads(_doctor(base, "--json"))
    found = [f for f in report["findings"]
             if any(e["metric"] == "/readyz" for e in f["evidence"])]
    assert found and report["worst"] in ("critical", "warning")
    assert report["readiness"]["degraded"] is True
    return found


def _redis(*args: str) -> tuple[Proc, str]:
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           *args]
    return Proc(cmd, ready_port=port), f"redis://127.0.0.1:{port}/0"


def test_an_evicting_redis_is_a_finding(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    server, url = _redis("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    with server:
        gw, base = acme_gateway(sim, url, ADMIN, {"rpm": 100})
        with gw:
            said = _doctor(base)
            assert "maxmemory-policy allkeys-lru" in said
            assert "set maxmemory-policy noeviction" in said
            (finding,) = _readyz_findings(base)
            assert finding["severity"] == "warning" and finding["class"] == "gateway"
            assert finding["pool"] is None
            assert "noeviction" in finding["action"]
            _doctor(base, "--fail-on", "warning", status=3)


def test_a_salt_secrets_key_of_another_type_is_a_finding(redis_url: str,
                                                        sim_factory: SimFactory) -> None:
    redis.Redis.from_url(redis_url).set("kvgate:salt_secrets", "written by hand")
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"rpm": 100})
    with gw:
        said = _doctor(base)
        assert "delete the key kvgate:salt_secrets" in said
        (finding,) = _readyz_findings(base)
        assert finding["severity"] == "warning"
        assert finding["action"].startswith("delete the key kvgate:salt_secrets")


def test_gateways_with_different_salt_secrets_are_a_finding(
        redis_url: str, sim_factory: SimFactory, procs: list[Proc]) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    first, _ = acme_gateway(sim, redis_url, ADMIN, {"rpm": 100})
    procs.append(first.start())
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}}}
    other, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": OTHER_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
        "KVGATE_REDIS_URL": redis_url})
    procs.append(other.start())  # its first check, before it answers /readyz, sees the other
    said = _doctor(base)
    assert "give every gateway the same salt secret" in said
    (finding,) = _readyz_findings(base)
    assert "different secrets" in finding["summary"]


@contextmanager
def _front(gateway: str, readyz: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """A proxy in front of the gateway that passes /admin/doctor and answers /readyz with
    ``readyz`` (a page of its own, or a closed connection)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # (http.server's name)
            if self.path.startswith("/readyz"):
                readyz(self)
                return
            got = httpx.get(f"{gateway}{self.path}", timeout=30,
                            headers={"authorization": self.headers["authorization"] or ""})
            self.send_response(got.status_code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(got.content)))
            self.end_headers()
            self.wfile.write(got.content)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _html(handler: BaseHTTPRequestHandler) -> None:
    body = b"<html>welcome, secret=" + AUTH_SECRET.encode() + b"</html>"
    handler.send_response(200)
    handler.send_header("content-type", "text/html")
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _hang_up(handler: BaseHTTPRequestHandler) -> None:
    handler.close_connection = True  # nothing written: the client reads a closed connection


def test_a_readyz_not_json_or_unreachable_is_a_finding(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw:
        for answer, words in ((_html, "HTTP 200, not kvgate's readiness JSON"),
                              (_hang_up, "/readyz could not be read")):
            with _front(base, answer) as front:
                said = _doctor(front)  # the report is printed all the same: exit 0
                assert words in said and "could not be read" in said
                report = json.loads(_doctor(front, "--json"))
                (finding,) = report["readiness"]["findings"]
                assert finding["severity"] == "warning" and finding in report["findings"]
        # the gateway itself: ready, not degraded, nothing added
        report = json.loads(_doctor(base, "--json"))
        assert report["readiness"] == {"url": f"{base}/readyz", "http_status": 200,
                                       "status": "ready", "degraded": False, "findings": []}
