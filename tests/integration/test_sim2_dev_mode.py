"""`kvgate sim` with `VLLM_SERVER_DEV_MODE=1` serves vLLM's sleep-mode and cache routes: `POST
/sleep?level=1`, `POST /wake_up`, `GET /is_sleeping`, `POST /reset_prefix_cache`. Asleep, the
replica's KV cache is discarded (vLLM's sleep mode): after the wake-up a prompt cached before
is computed again. Without dev mode the routes do not exist (404), as vLLM's. A real simulator
process, httpx."""

from __future__ import annotations

import httpx

from tests.support.procs import Proc, sim_proc

BODY = {"model": "sim-model", "max_tokens": 1,
        "messages": [{"role": "user", "content": "an opening worth caching " * 40}]}


def _cached(url: str) -> int:
    reply = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=30)
    assert reply.status_code == 200
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _sim(procs: list[Proc], dev: bool) -> str:
    proc, url = sim_proc(None, "--time-scale", "50", "--enable-prompt-tokens-details")
    if dev:
        proc.env["VLLM_SERVER_DEV_MODE"] = "1"
    procs.append(proc.start())
    return url


def test_sleep_discards_the_cache_and_wake_up_serves_again(procs: list[Proc]) -> None:
    url = _sim(procs, dev=True)
    assert _cached(url) == 0
    assert _cached(url) > 0
    assert httpx.post(f"{url}/sleep", params={"level": "1"}).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    assert httpx.post(f"{url}/wake_up").status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    assert _cached(url) == 0  # its KV cache went with the sleep
    assert _cached(url) > 0
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
    assert _cached(url) == 0
    assert _cached(url) > 0
    for level in (1, 0):  # the test hook's sleep discards it too
        assert httpx.post(f"{url}/sim/faults", json={"sleeping": level}).status_code == 200
    assert _cached(url) == 0


def test_without_dev_mode_the_routes_are_absent(procs: list[Proc]) -> None:
    url = _sim(procs, dev=False)
    assert httpx.post(f"{url}/sleep", params={"level": "1"}).status_code == 404
    assert httpx.get(f"{url}/is_sleeping").status_code == 404
