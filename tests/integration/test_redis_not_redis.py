"""`KVGATE_REDIS_URL` naming a port where another service answers (an HTTP server here: a
port number mixed up in a config): the log, /readyz and `kvgate_redis_down_cause` say the
server is not Redis. They said "cannot reach Redis at ... (InvalidResponse)" and the cause
"unreachable", which sent operators to the network. Requests get a clear 503."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.gateway import AUTH_SECRET, gateway_proc, metric_values, wait_for

ADMIN = "not-redis-admin-token-0123456789"
SAID = "the server there is not Redis"


def _answer_http(conn: socket.socket) -> None:
    with conn:
        try:
            while conn.recv(4096):
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        except OSError:
            pass


@pytest.fixture
def http_port() -> Iterator[int]:
    """A TCP server on loopback answering everything as a web server would."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_answer_http, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    done.set()
    thread.join(5)
    server.close()


def _said(output: str, logger: str) -> list[str]:
    return [doc["msg"] for line in output.splitlines() if line.startswith("{")
            and (doc := orjson.loads(line))["logger"] == logger]


def test_a_port_that_is_not_redis_is_named_so(http_port: int) -> None:
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": f"redis://127.0.0.1:{http_port}/0"}
    gw, base = gateway_proc(config=config, env=env, auth=True, ready=False)
    with gw:
        def ready() -> dict[str, Any]:
            body: dict[str, Any] = httpx.get(f"{base}/readyz", timeout=5).json()
            return body

        wait_for(lambda: SAID in str(ready()["tenancy"]["reason"])
                 and SAID in str(ready()["sync"].get("reason")), 20, "/readyz naming it")
        causes = metric_values(base, "kvgate_redis_down_cause")
        assert causes['{cause="notredis"}'] == 1.0, causes
        sync = metric_values(base, "kvgate_sync_down_cause")
        assert sync['{cause="notredis"}'] == 1.0, sync
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-anything", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert refused.value.status_code == 503
        assert "Traceback" not in refused.value.response.text
        gw.stop()
        output = gw.output(tail=None)
    store = _said(output, "gateway.tenancy.reachability")
    assert len(store) == 1 and SAID in store[0], store
    assert store[0].startswith(f"cannot reach Redis at 127.0.0.1:{http_port} ("), store
    assert "InvalidResponse" not in output and "HTTP/1.1" not in output
