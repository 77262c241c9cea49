"""The ext_proc filter's body modes an operator may configure on Envoy (`gateway/epp/modes.py`).

``BUFFERED`` request bodies (a data plane that buffers the body before the picker sees it)
are served as ``FULL_DUPLEX_STREAMED`` ones: the picker answered nothing to the headers
while it waited for the body, Envoy sent no body until the headers were answered, and the
client waited ``server.body_timeout_s`` (60 s) for a 408 (past the client's 30 s here).
Modes in which no pick is possible (the body after the headers went upstream, or never; an
answer path other than ``FULL_DUPLEX_STREAMED``) are a 500 at once naming the mode, nothing
sent to a replica.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import AUTH_SECRET, admin_client, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
ADMIN = "epp-modes-admin-token-0123456789"


@dataclass
class Picker:
    picker: str  # gRPC address
    base: str  # HTTP port: /metrics, admin API
    sim: str
    key: str
    proc: Proc


@pytest.fixture(scope="module")
def picker() -> Iterator[Picker]:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, model=MODEL)
        procs.append(sim.start())
        epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}},
                       auth=True,
                       env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
        procs.append(epp.start())
        with admin_client(epp.base, ADMIN) as admin:
            assert admin.post("/tenants", json={"id": "acme", "tier": "default"}) \
                .status_code == 201
            key = admin.post("/tenants/acme/keys").json()["key"]
        yield Picker(epp.picker, epp.base, url, key, epp)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _modes(**modes: str) -> Callable[[dict[str, Any]], None]:
    """An `envoy_proc` edit setting the ext_proc filter's processing modes."""
    def edit(config: dict[str, Any]) -> None:
        (listener,) = config["static_resources"]["listeners"]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        (ext_proc,) = [f for f in manager["http_filters"]
                       if f["name"] == "envoy.filters.http.ext_proc"]
        ext_proc["typed_config"]["processing_mode"].update(modes)
    return edit


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for proc in reversed(started):
        proc.stop()


def _envoy(procs: list[Proc], picker: Picker, **modes: str) -> str:
    envoy, base = envoy_proc(picker.picker, edit=_modes(**modes))
    procs.append(envoy.start())
    return base


def _seen(sim: str) -> list[dict[str, Any]]:
    requests: list[dict[str, Any]] = httpx.get(f"{sim}/sim/requests", timeout=10) \
        .json()["requests"]
    return requests


def test_buffered_request_bodies_are_picked_and_rewritten(
    picker: Picker, procs: list[Proc],
) -> None:
    base = _envoy(procs, picker, request_body_mode="BUFFERED")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=picker.key, max_retries=0,
                           timeout=30)
    msgs: Any = [{"role": "user", "content": "Hello there"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=msgs, max_tokens=3, extra_body={"cache_salt": "stolen"})
    chat = raw.parse()
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    (seen,) = [r for r in _seen(picker.sim)
               if r["headers"].get("x-request-id") == raw.headers["x-request-id"]]
    assert seen["body"]["messages"] == msgs
    assert seen["body"]["cache_salt"] not in ("", "stolen")  # the tenant's, set by the picker
    assert picker.key not in str(seen["headers"])
    assert seen["headers"]["x-gateway-destination-endpoint"] == \
        picker.sim.removeprefix("http://")
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4,
                                            stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # kvgate's usage chunk removed, as streamed
    wait_for(lambda: set(metric_values(picker.base, "kvgate_inflight_requests").values())
             == {0.0}, 30, "in-flight back to 0")


@pytest.mark.parametrize("modes", [
    {"request_body_mode": "STREAMED"},
    {"request_body_mode": "NONE"},
    {"response_body_mode": "BUFFERED"},
], ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_modes_without_a_pick_are_refused_naming_the_mode(
    picker: Picker, procs: list[Proc], modes: dict[str, str],
) -> None:
    base = _envoy(procs, picker, **modes)
    before = len(_seen(picker.sim))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=picker.key, max_retries=0,
                           timeout=30)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 500
    message = err.value.body["message"]  # type: ignore[index]
    (name, value), = modes.items()
    assert f"{name} {value}" in message and "FULL_DUPLEX_STREAMED" in message
    assert len(_seen(picker.sim)) == before  # nothing reached the replica
    # a request with no body needs no pick from one: kvgate's own pages still answer
    models = httpx.get(f"{base}/v1/models", timeout=30,
                       headers={"authorization": f"Bearer {picker.key}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_a_buffered_body_not_in_in_time_is_the_408(procs: list[Proc]) -> None:
    """Envoy holds a ``BUFFERED`` body until its end; the picker, which has answered the
    headers, still bounds its arrival (`server.body_timeout_s`), as in the shipped mode. (It
    did before too: that 408 was then every buffered request's answer.)"""
    sim, url = sim_proc(None, model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}},
                           "server": {"body_timeout_s": 1}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker, edit=_modes(request_body_mode="BUFFERED"))
    procs.append(envoy.start())
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "never ends", "max_tokens": 2}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % (len(body) + 100))
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if b"}}" in answer:
                break
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"RequestTimeoutError" in rest and b"did not arrive in time" in rest
    wait_for(lambda: set(metric_values(epp.base, "kvgate_inflight_requests").values())
             == {0.0}, 30, "in-flight back to 0")
    assert _seen(url) == []


def test_skipped_response_headers_are_said_in_the_log(
    picker: Picker, procs: list[Proc],
) -> None:
    """Envoy does not state the header modes: with the answers' headers skipped they pass, but
    the picker never sees a status (each counted 499, no usage charged). Nothing showed it;
    the log says it once."""
    base = _envoy(procs, picker, response_header_mode="SKIP")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=picker.key, max_retries=0,
                           timeout=30)
    done = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert done.choices[0].text
    wait_for(lambda: "response_header_mode SKIP" in picker.proc.output(None), 30,
             "the misconfiguration in the picker's log")
