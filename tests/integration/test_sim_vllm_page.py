"""`kvgate sim`'s surface where it differed from vLLM 0.34's: the `/metrics` page's 0.34 series
(waiting by reason, the sleep-state gauge, counters' `_created` samples, the default prefix
hash), vLLM's sleep mode (the engine schedules nothing, the gauge says so) and the `--api-key`
middleware, which answers before routing."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]


def _samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics").text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def _sleep_state(url: str) -> dict[tuple[str, str], float]:
    return {(ls["engine"], ls["sleep_state"]): v for n, ls, v in _samples(url)
            if n == "vllm:engine_sleep_state"}


def test_the_page_has_vllm_034s_series(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50", "--data-parallel-size", "2")
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
               timeout=30).raise_for_status()
    samples = _samples(url)
    by_reason = {(ls["engine"], ls["reason"]) for n, ls, _ in samples
                 if n == "vllm:num_requests_waiting_by_reason"}
    assert by_reason == {(e, r) for e in "01" for r in ("capacity", "deferred")}
    assert _sleep_state(url) == {(e, s): float(s == "awake") for e in "01"
                                 for s in ("awake", "weights_offloaded", "discard_all")}
    names = {n for n, _, _ in samples}
    assert {"vllm:prompt_tokens_created", "vllm:request_success_created"} <= names
    info = [ls for n, ls, _ in samples if n == "vllm:cache_config_info"]
    assert {ls["prefix_caching_hash_algo"] for ls in info} == {"sha256"}


def test_sleep_mode_holds_requests_and_says_so(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50")
    httpx.post(f"{url}/sim/faults", json={"sleeping": 1}).raise_for_status()
    assert _sleep_state(url)[("0", "awake")] == 0.0
    assert _sleep_state(url)[("0", "weights_offloaded")] == 1.0
    answers: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    sender = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{url}/v1/completions", json=body, timeout=60)))
    sender.start()
    # asleep: the request waits in the engine, unanswered
    wait_for(lambda: httpx.get(f"{url}/sim/stats").json()["waiting"] == 1, timeout=20)
    assert not answers and httpx.get(f"{url}/health").status_code == 200
    httpx.post(f"{url}/sim/faults", json={"sleeping": 0}).raise_for_status()
    sender.join(timeout=60)
    assert answers and answers[0].status_code == 200, answers
    assert _sleep_state(url)[("0", "awake")] == 1.0
    bad = httpx.post(f"{url}/sim/faults", json={"sleeping": 3})
    assert bad.status_code == 400


def test_the_api_key_is_checked_before_routing(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50", "--api-key", "k1")
    for path in ("/v1/no-such-route", "/v2/rerank"):
        resp = httpx.post(f"{url}{path}", json={})
        assert (resp.status_code, resp.json()) == (401, {"error": "Unauthorized"}), path
    keyed = httpx.post(f"{url}/v1/no-such-route", json={}, headers={"Authorization": "Bearer k1"})
    assert keyed.status_code == 404
    assert httpx.get(f"{url}/metrics").status_code == 200  # not a checked prefix


def test_several_served_model_names(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50", "--served-model-name", "llama", "llama-8b",
                         model="org/Llama-3.1-8B-Instruct")
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("llama", "org/Llama-3.1-8B-Instruct", None),
        ("llama-8b", "org/Llama-3.1-8B-Instruct", None)]
    for name in ("llama", "llama-8b", None):  # each name, or none: the first
        body = {"model": name, "prompt": "x", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    wrong = httpx.post(f"{url}/v1/completions", json={"model": "org/Llama-3.1-8B-Instruct",
                                                       "prompt": "x", "max_tokens": 2})
    assert wrong.status_code == 404  # the path is no served name
    names = {ls.get("model_name") for n, ls, _ in _samples(url)
             if n.startswith("vllm:") and n != "vllm:cache_config_info"}  # (no model_name)
    assert names == {"llama"}  # metrics carry the first name
