"""A client that leaves while its request waits in kvgate, before any replica has it, costs the
replicas nothing: the request is not sent afterwards. It waited for its tenant's admission on
a Redis that did not answer (frozen with SIGSTOP, as a long fork or script holds it); once Redis
answered, the request went to a replica on a kept-alive connection and was aborted there only
afterwards, when kvgate's disconnect watch ran -- a prefill the replica may already have
scheduled. A real gateway with limits in a real Redis, a simulated replica (its
`/sim/stats` counts what it received), a raw socket that resets its connection.

The picker behind Envoy has no such window: Envoy holds the request until the picker answers
its body, and a client that leaves ends the downstream request, and with it the ext_proc
stream (gRPC cancels the exchange's handler): nothing is left to send, whenever the admission
ends. Checked through a real Envoy alike (the picker's request line: 499, no attempt).
"""

from __future__ import annotations

import json
import signal
import socket
import struct
from collections.abc import Callable
from typing import Any

import httpx

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, inflight, wait_for
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "gone-admin-token-0123456789"


def _config(sim: str) -> dict[str, Any]:
    return {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"max_concurrency": 4}}},
        "tenants": [{"id": "acme", "tier": "free"}],
        # Redis is frozen for a moment: the admission waits for it, nothing degrades
        "tenancy": {"redis_timeout_s": 30},
        "sync": {"timeout_s": 30},
    }


def _env(redis_url: str) -> dict[str, str]:
    return {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
            "KVGATE_REDIS_URL": redis_url}


def _gateway(sim: str, redis_url: str) -> tuple[Proc, str]:
    return gateway_proc(config=_config(sim), env=_env(redis_url), auth=True)


def _received(sim: str) -> int:
    return int(httpx.get(f"{sim}/sim/stats", timeout=10).json()["received"])


def _warmed(base: str, key: str) -> tuple[bytes, dict[str, str]]:
    """The test's request and headers, asked once: the edge (kvgate, or Envoy) then keeps a
    connection to the replica alive, so the next request would go at once."""
    body = json.dumps({"model": "llama", "max_tokens": 5,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    assert httpx.post(f"{base}/v1/chat/completions", content=body, headers=headers,
                      timeout=30).status_code == 200
    return body, headers


def test_a_client_gone_while_its_admission_waits_is_not_sent_to_a_replica(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    gw, base = _gateway(sim, url)
    with redis, gw:
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        body, headers = _warmed(base, key)
        before = _received(sim)
        assert redis.popen is not None
        redis.popen.send_signal(signal.SIGSTOP)
        try:
            client = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                           + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
                           + b"content-length: %d\r\n\r\n" % len(body) + body)
            httpx.get(f"{base}/healthz", timeout=10)  # read by now: it waits on Redis
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # a reset: the gateway's connection is gone at once
            httpx.get(f"{base}/healthz", timeout=10)  # its event loop has run since
        finally:
            redis.popen.send_signal(signal.SIGCONT)
        wait_for(lambda: '"status":499' in gw.output(None), timeout=30,
                 what="the abandoned request's log line")
        assert _received(sim) == before  # the replica never had it
        line = next(ln for ln in gw.output(None).splitlines() if '"status":499' in ln)
        assert '"attempts":0' in line
        assert inflight(base) == 0
        with httpx.Client(base_url=f"{base}/v1", headers=headers, timeout=30) as client_:
            # its concurrency lease was given back: the tenant's four are all there
            for _ in range(4):
                assert client_.post("/chat/completions", content=body).status_code == 200


def _ext_proc_messages(envoy: Proc) -> float:
    """The messages Envoy has sent its picker (headers, body, ...), from its admin stats."""
    admin = envoy.ready_url.removesuffix("/ready") if envoy.ready_url else ""
    stats = httpx.get(f"{admin}/stats", params={"filter": "ext_proc"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in stats.splitlines()
               if line.split(":", 1)[0].endswith("ext_proc.stream_msgs_sent"))


def test_through_envoy_a_client_gone_while_its_admission_waits_is_not_sent(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    epp = epp_proc(config=_config(sim), env=_env(url), auth=True)
    with redis, epp:
        envoy, base = envoy_proc(epp.picker)
        with envoy:
            with admin_client(epp.base, ADMIN) as admin:
                key = admin.post("/tenants/acme/keys").json()["key"]
            body, headers = _warmed(base, key)
            before, sent = _received(sim), _ext_proc_messages(envoy)
            assert redis.popen is not None
            redis.popen.send_signal(signal.SIGSTOP)
            try:
                client = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
                client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                               + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
                               + b"content-length: %d\r\n\r\n" % len(body) + body)
                # the picker has its headers and body: its admission waits on Redis
                wait_for(lambda: _ext_proc_messages(envoy) >= sent + 2, 10,
                         "Envoy to send the request to the picker")
                # sent is not read: on a loaded machine the reset's cancel could reach the
                # picker with the messages, before it had the request (then nothing logged
                # it); its event loop has run twice since these answered
                for _ in range(2):
                    httpx.get(f"{epp.base}/healthz", timeout=10)
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # a reset: Envoy ends the request, and its ext_proc stream
                httpx.get(f"{base}/health", timeout=10)  # Envoy's worker has run since
            finally:
                redis.popen.send_signal(signal.SIGCONT)
            wait_for(lambda: '"status":499' in epp.output(None), timeout=30,
                     what="the abandoned request's log line")
            assert _received(sim) == before  # the replica never had it
            line = next(ln for ln in epp.output(None).splitlines() if '"status":499' in ln)
            assert '"attempts":0' in line, line
            assert inflight(epp.base) == 0
