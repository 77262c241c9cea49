"""A policy write naming the gateway itself as a replica is refused, as the start is.

`kvgate serve` and `kvgate epp` refuse to start with a replica at their own address (every
request sent to it comes back into the gateway, hop after hop), but `PUT`/`PATCH
/admin/policy` took `http://127.0.0.1:<own port>` (or `http://127.1:<own port>`) with a 200 and
the gateway then sent its requests to itself. Now such a write is a 400 naming the replica in
the start-up check's words, and nothing is stored. Each gateway checks its own ports: the
picker's are its gRPC and HTTP ports, not `kvgate serve`'s API port.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.epp import epp_proc
from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import free_port, sim_proc

ADMIN = "own-address-policy-admin-token-0"


def loop_line(pool: str, url: str, setting: str, port: int) -> str:
    return (f"pools.{pool}: the replica {url} is this gateway's own address ({setting} "
            f"{port}): its requests would come back to kvgate; list the vLLM server's "
            "address, or listen on another port")


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[httpx.Client, int, int, str]]:
    """(admin client on the admin port, API port, admin port, the sim replica's URL)."""
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    admin_port = free_port()
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}}}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
        "KVGATE_SERVER__ADMIN_PORT": str(admin_port)})
    port = int(base.rsplit(":", 1)[1])
    with sim, gw, admin_client(f"http://127.0.0.1:{admin_port}", ADMIN) as client:
        yield client, port, admin_port, url


def _refused(admin: httpx.Client, r: httpx.Response, line: str, before: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == line and err["param"] == line.partition(":")[0], err
    after = admin.get("/policy")
    assert after.headers["etag"] == before.headers["etag"]  # nothing written
    assert after.json() == before.json()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1", "localhost"])
def test_a_put_naming_the_api_port_is_refused(
    gateway: tuple[httpx.Client, int, int, str], host: str
) -> None:
    admin, port, _, sim = gateway
    before = admin.get("/policy")
    policy: dict[str, Any] = before.json()
    own = f"http://{host}:{port}"
    policy["pools"]["p"]["replicas"] = [sim, own]
    _refused(admin, admin.put("/policy", json=policy), loop_line("p", own, "server.port", port),
             before)


def test_a_patch_naming_the_admin_port_is_refused(
    gateway: tuple[httpx.Client, int, int, str],
) -> None:
    admin, _, admin_port, _ = gateway
    before = admin.get("/policy")
    own = f"http://127.1:{admin_port}"
    patch = {"pools": {"q": {"served_model": "m", "replicas": [own]}}}
    _refused(admin, admin.patch("/policy", json=patch),
             loop_line("q", own, "server.admin_port", admin_port), before)


def test_another_port_of_this_machine_is_taken(
    gateway: tuple[httpx.Client, int, int, str],
) -> None:
    admin, _, _, _ = gateway
    other = f"http://127.0.0.1:{free_port()}"  # a replica here, not the gateway
    made = admin.patch("/policy", json={"pools": {"r": {"served_model": "m",
                                                        "replicas": [other]}}})
    assert made.status_code == 200, made.text
    assert admin.patch("/policy", json={"pools": {"r": None}}).status_code == 200


def test_the_picker_checks_its_own_ports() -> None:
    """`kvgate epp` has no API port (its `server.port` is 0): its HTTP and gRPC ports are
    refused, and the default API port of `kvgate serve` is no address of its own."""
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}}}
    epp = epp_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    http_port = int(epp.base.rsplit(":", 1)[1])
    grpc_port = int(epp.picker.rsplit(":", 1)[1])
    with sim, epp, admin_client(epp.base, ADMIN) as admin:
        for own, setting, port in [(f"http://127.0.0.1:{http_port}", "server.admin_port",
                                    http_port),
                                   (f"http://localhost:{grpc_port}", "epp.port", grpc_port)]:
            before = admin.get("/policy")
            patch = {"pools": {"p": {"replicas": [url, own]}}}
            _refused(admin, admin.patch("/policy", json=patch),
                     loop_line("p", own, setting, port), before)
        # `kvgate serve`'s default API port: the picker does not listen there
        taken = admin.patch("/policy", json={"pools": {"p": {"replicas": [
            url, "http://127.0.0.1:8000"]}}})
        assert taken.status_code == 200, taken.text
