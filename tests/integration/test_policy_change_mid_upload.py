"""A request whose pool a policy change removes while its body is on its way goes where the
policy in force sends its model.

The gateway identifies a request (its key, its tenant, the policy snapshot it is planned on)
when the headers arrive, before the body is read and the request admitted against its limits.
An operator moving a model to another pool and removing the old one meanwhile (a rollout)
made it a 503 "The pool for `llama` is not running here.", its whole upload wasted, although
the policy in force served `llama` from the new pool.

A real gateway on Redis, two simulated replicas (pools `p1` and `p2`), a raw socket for the
client whose body comes late, the admin API for the change.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc

ADMIN = "mid-upload-admin-token-0123456789"
BODY = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one whole answer with a content-length."""
    sock.settimeout(20)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(rest) < int(headers["content-length"]):
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, rest


def test_a_request_whose_pool_is_removed_during_its_upload_goes_to_the_new_pool(
        sim_factory: Callable[..., tuple[Proc, str]], redis_url: str) -> None:
    _, sim1 = sim_factory("--time-scale", "50", model="m")
    _, sim2 = sim_factory("--time-scale", "50", model="m")
    config = {"pools": {"p1": {"served_model": "m", "replicas": [sim1]},
                        "p2": {"served_model": "m", "replicas": [sim2]}},
              "models": {"llama": {"free": "p1"}}, "tiers": {"free": {}},
              "tenants": [{"id": "acme", "tier": "free"}]}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\n"
                         b"authorization: Bearer " + key.encode() + b"\r\n"
                         b"content-length: %d\r\n\r\n" % len(BODY))
            time.sleep(0.3)  # identified on the policy that sends `llama` to p1
            doc = admin.get("/policy").json()
            moved = admin.put("/policy", json={**doc, "pools": {"p2": doc["pools"]["p2"]},
                                               "models": {"llama": {"free": "p2"}}})
            assert moved.status_code == 200 and moved.headers["x-kvgate-in-force"] == "true"
            sock.sendall(BODY)
            status, headers, body = _answer(sock)
        assert status == 200, body
        assert headers["x-kvgate-replica"].startswith("p2/"), headers
        assert json.loads(body)["choices"]
        # and a request that comes in now goes there too, as before
        answer = httpx.post(f"{base}/v1/chat/completions", content=BODY, timeout=20,
                            headers={"authorization": f"Bearer {key}",
                                     "content-type": "application/json"})
        assert answer.status_code == 200 and answer.headers["x-kvgate-replica"].startswith("p2/")
