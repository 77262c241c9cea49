"""A replica URL kvgate could not reach is refused on input, a 400 naming it, nothing stored.

`PATCH /admin/policy` answered 200 to URLs that split into a scheme, a host and a port but that
no request could use: a query or fragment (``/health`` and ``/v1/...`` went into it: the
replica answered 404 to every check and stayed out), port 0 (its id read ``:80``), a host with
a space, a CR LF or a label over 63 characters (the resolver raised `UnicodeError`: the health
checks' task ended for every pool and each request got a text/plain 500). The configuration
file is held to the same rule. A URL kvgate can reach (a path prefix, a bracketed IPv6
address, a name with '_') is taken.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.config import KvgateConfig
from tests.support.gateway import admin_client, chat_status, gateway_proc
from tests.support.procs import sim_proc

ADMIN = "replica-url-input-admin-token-0"
BAD = [
    ("http://127.0.0.1:8000?x=1", "a replica URL has no query or fragment"),
    ("http://127.0.0.1:8000#frag", "a replica URL has no query or fragment"),
    ("http://127.0.0.1:8000/?", "a replica URL has no query or fragment"),
    ("http://127.0.0.1:0", "a replica URL's port is 1 to 65535"),
    ("http://vllm a:8000", "a replica URL holds no space or control character"),
    ("http://vllm\r\nx:8000", "a replica URL holds no space or control character"),
    ("http://" + "a" * 64 + ":8000", f"{'a' * 64!r} is not a host name"),
    ("http://" + "a." * 127 + "ab:8000", f"{'a.' * 127 + 'ab'!r} is not a host name"),
    ("http://a..b:8000", "'a..b' is not a host name"),
    ("http://a*b:8000", "'a*b' is not a host name"),
]


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[httpx.Client, str, str]]:
    """(admin client, the gateway's base URL, the sim replica's URL)."""
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with sim, gw, admin_client(base, ADMIN) as client:
        yield client, base, url


@pytest.mark.parametrize(("url", "why"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_replica_url_kvgate_cannot_reach_is_refused(
    gateway: tuple[httpx.Client, str, str], url: str, why: str,
) -> None:
    admin, base, sim = gateway
    before = admin.get("/policy")
    r = admin.patch("/policy", json={"pools": {"p": {"replicas": [sim, url]}}},
                    headers={"content-type": "application/merge-patch+json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "pools.p.replicas", err
    assert err["message"].startswith(f"pools.p.replicas: {url!r}: {why}"), err
    after = admin.get("/policy")
    assert after.headers["etag"] == before.headers["etag"]  # nothing written
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    assert chat_status(client) == 200  # its replica serves on


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/vllm", "http://[::1]:8000",
                                 "http://vllm_0.svc.cluster.local:8000", "https://Host.example"])
def test_a_replica_url_kvgate_can_reach_is_taken(url: str) -> None:
    cfg = KvgateConfig.model_validate({"pools": {"p": {"replicas": [url]}}})
    assert cfg.pools["p"].replicas == [url.replace("Host", "host")]


@pytest.mark.parametrize(("url", "why"), BAD[:5], ids=[str(i) for i in range(5)])
def test_the_configuration_file_is_held_to_the_same_rule(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=r"pools\.p\.replicas") as caught:
        KvgateConfig.model_validate({"pools": {"p": {"replicas": [url]}}})
    assert why in str(caught.value)
