"""The picker or Envoy killed with requests in flight, then started again (the same ports).

- The picker killed: a request past its answer is cut too (its answer passes through the
  picker): a stream without its end (no ``[DONE]``, never complete to a client), a whole answer
  not sent yet the bootstrap's 503; new requests get that 503 until the picker is back, then
  are picked again.
- Envoy killed: the picker sees every ext_proc stream end and releases each exchange (the
  replicas' in-flight counts, the tenants' concurrency leases; counted 499).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from gateway.epp.envoy import PICKER_DOWN
from tests.support.epp import EppProc, envoy_proc, epp_proc
from tests.support.gateway import AUTH_SECRET, admin_client, inflight, request_statuses, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
ADMIN = "epp-admin-token-0123456789"
LONG = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "ignore_eos": True}



def _stack(procs: list[Proc], *, auth: bool) -> tuple[EppProc, EppProc, str]:
    sim, url = sim_proc(None, "--time-scale", "1", model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"default": {"served_model": MODEL, "replicas": [url]}}},
                   auth=auth, env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker)
    procs.append(envoy.start())
    return epp, envoy, base


def _stream(base: str, headers: dict[str, str], out: list[Any], started: threading.Event) -> None:
    """A long stream read to its end; `out` gets what ended it and whether [DONE] came."""
    got = b""
    try:
        with httpx.stream("POST", f"{base}/v1/completions", headers=headers, timeout=60,
                          json={**LONG, "stream": True}) as resp:
            out.append(resp.status_code)
            for chunk in resp.iter_raw():
                got += chunk
                started.set()
        out.append("ended")
    except httpx.HTTPError as exc:
        out.append(type(exc).__name__)
    finally:
        started.set()
        out.append(b"[DONE]" in got)


def _picker_down(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"] == PICKER_DOWN


def test_a_killed_picker_cuts_its_answers_and_a_restarted_one_picks_again(
    procs: list[Proc],
) -> None:
    epp, _, base = _stack(procs, auth=False)
    streamed: list[Any] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream, args=(base, {}, streamed, started))
    reader.start()
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(httpx.post, f"{base}/v1/completions", json=LONG, timeout=60)
        assert started.wait(30)
        wait_for(lambda: inflight(epp.base) == 2, what="both requests at the replica")
        epp.kill()
        reader.join(60)
        status, ended, done = streamed  # cut: a broken stream, never read as complete
        assert status == 200 and ended in ("RemoteProtocolError", "ReadError") and not done
        _picker_down(whole.result(60))
    _picker_down(httpx.post(f"{base}/v1/completions", json={**LONG, "max_tokens": 2},
                            timeout=30))
    epp.start()  # the same ports: Envoy reconnects on its own

    def picked() -> bool:
        resp = httpx.post(f"{base}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
        return resp.status_code == 200 and "x-kvgate-route" in resp.headers

    wait_for(picked, timeout=30, what="requests picked again")
    assert inflight(epp.base) == 0


def test_a_killed_envoy_leaves_no_exchange_held(procs: list[Proc]) -> None:
    epp, envoy, base = _stack(procs, auth=True)
    with admin_client(epp.base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "t1", "tier": "default",
                                            "limits": {"max_concurrency": 3}}).status_code == 201
        key = admin.post("/tenants/t1/keys").json()["key"]
    auth = {"Authorization": f"Bearer {key}"}
    outs: list[list[Any]] = [[] for _ in range(3)]
    events = [threading.Event() for _ in outs]
    readers = [threading.Thread(target=_stream, args=(base, auth, out, ev))
               for out, ev in zip(outs, events, strict=True)]
    for reader in readers:
        reader.start()
    for ev in events:
        assert ev.wait(30)
    wait_for(lambda: inflight(epp.base) == 3, what="three streams at the replica")
    envoy.kill()
    for reader in readers:
        reader.join(60)
    wait_for(lambda: inflight(epp.base) == 0, what="every exchange released")
    assert request_statuses(epp.base).get("499") == 3
    envoy.start()
    # the tenant's three concurrency leases came back: three streams at once are admitted

    def short(_: int) -> int:
        body = {**LONG, "max_tokens": 300, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", headers=auth, json=body,
                          timeout=60) as resp:
            resp.read()
            return resp.status_code

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(short, range(3))) == [200, 200, 200]
    wait_for(lambda: inflight(epp.base) == 0, what="no request in flight")
