"""`KVGATE_REDIS_URL` with TLS (``rediss://``) as operators get it wrong: at a Redis port
without TLS, at a TLS Redis whose certificate the gateway does not trust, and ``redis://`` at
a port that serves only TLS. The log line
names the problem (it said "timed out", and "operation not permitted" for the certificate:
the SSL error's OpenSSL code read as an errno), never the password; with the CA given, the
gateway works."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import Proc, free_port, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "tls-admin-token-0123456789"
PASSWORD = "tls-pass-Zq81"  # tests only


def tls_redis(tmp_path: Path) -> tuple[Proc, int, Path]:
    """redis-server serving TLS only, with a fresh self-signed certificate for 127.0.0.1
    (not started). Returns (proc, port, the certificate's path)."""
    openssl, exe = shutil.which("openssl"), shutil.which("redis-server")
    assert openssl is not None and exe is not None
    cert, key = tmp_path / "redis.crt", tmp_path / "redis.key"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    cmd = [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
           "--tls-cert-file", str(cert), "--tls-key-file", str(key),
           "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
           "--save", "", "--appendonly", "no", "--requirepass", PASSWORD]
    return Proc(cmd, ready_port=port), port, cert


def gateway(sim: str, url: str, *, ready: bool) -> tuple[Proc, str]:
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url}
    return gateway_proc(config=config, env=env, auth=True, ready=ready)


def redis_lines(gw: Proc) -> str:
    """The gateway's log lines about Redis, once both the store and the sharing said one."""
    def said() -> bool:
        return gw.output().count("cannot reach Redis") >= 2
    wait_for(said, timeout=20, what="the Redis lines")
    return "\n".join(line for line in gw.output().splitlines() if "Redis" in line)


def test_rediss_at_a_port_without_tls_says_so(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    plain, url = redis_proc()
    tls_url = url.replace("redis://", f"rediss://kv:{PASSWORD}@")
    gw, base = gateway(sim, tls_url, ready=False)
    with plain, gw:
        lines = redis_lines(gw)
        assert "TLS handshake" in lines and "use redis:// or the TLS port" in lines, lines
        assert PASSWORD not in gw.output()
        assert httpx.get(f"{base}/readyz").status_code == 503


def test_an_untrusted_certificate_is_named_and_a_trusted_one_works(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    server, port, cert = tls_redis(tmp_path)
    url = f"rediss://default:{PASSWORD}@127.0.0.1:{port}/0"
    untrusting, _ = gateway(sim, url, ready=False)
    trusting, base = gateway(sim, f"{url}?ssl_ca_certs={cert}", ready=True)
    plain, _ = gateway(sim, url.replace("rediss://", "redis://"), ready=False)
    with server, untrusting, plain:
        lines = redis_lines(untrusting)
        assert "TLS certificate refused: self-signed certificate" in lines, lines
        assert "operation not permitted" not in lines
        assert PASSWORD not in untrusting.output()
        lines = redis_lines(plain)  # it said "connection reset by peer" and nothing more
        assert "serves only TLS resets plain connections: rediss://" in lines, lines
        assert PASSWORD not in plain.output()
        with trusting:
            ready = httpx.get(f"{base}/readyz").json()
            assert not ready["tenancy"]["degraded"] and not ready["sync"]["degraded"], ready
            assert PASSWORD not in trusting.output()
