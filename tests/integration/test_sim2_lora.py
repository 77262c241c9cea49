"""`kvgate sim --lora-modules` serves LoRA adapters as a vLLM replica started with
`--enable-lora` does: a card per adapter with the base model as `parent`, requests naming it
answered under its name, its KV cache its own (vLLM hashes the LoRA name into the first block),
and adapters loaded and unloaded at run time. A real simulator process, the openai client."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.vllm_page import parse_vllm_metrics
from tests.support.gateway import wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
MSG: list[Any] = [{"role": "user", "content": "the same long opening for both " * 40}]


def _cached(client: openai.OpenAI, model: str) -> int:
    reply = client.chat.completions.create(model=model, messages=MSG, max_tokens=2)
    assert reply.model == model  # answered under the name asked for
    details = reply.usage.prompt_tokens_details if reply.usage else None
    assert details is not None and details.cached_tokens is not None
    return details.cached_tokens


def test_adapters_listed_served_and_cached_apart(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50", "--enable-prompt-tokens-details",
                         "--lora-modules", "sql=/adapters/sql", model="base")
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models").json()["data"]}
    assert set(cards) == {"base", "sql"}
    assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("base", "/adapters/sql")
    assert cards["base"]["parent"] is None
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert _cached(client, "base") == 0
    assert _cached(client, "sql") == 0  # the adapter's KV is not the base model's
    assert _cached(client, "sql") > 0
    assert _cached(client, "base") > 0


def test_adapters_loaded_and_unloaded_at_run_time(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50", "--enable-lora", model="base")
    load = {"lora_name": "chat2", "lora_path": "/adapters/chat2"}
    first = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert first.status_code == 200 and "chat2" in first.text
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert "chat2" in [c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]]
    body = {"model": "chat2", "prompt": "x", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat2"})
    assert gone.status_code == 200
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat2"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 404


def test_lora_requests_info_names_the_adapters_in_flight(sim_factory: SimFactory) -> None:
    """vLLM's `vllm:lora_requests_info` gauge: `max_lora`, and the adapters of the requests
    in flight comma-joined in a label; kvgate's page parser reads such a page as any other."""
    _, url = sim_factory("--time-scale", "50", "--max-loras", "2",
                         "--lora-modules", "sql=/a/sql", "chat=/a/chat", model="base")

    def info() -> dict[str, str]:
        found = [s.labels for f in text_string_to_metric_families(httpx.get(f"{url}/metrics")
                                                                   .text)
                 for s in f.samples if s.name == "vllm:lora_requests_info"]
        assert len(found) == 1
        return found[0]

    assert info() == {"max_lora": "2", "running_lora_adapters": "",
                      "waiting_lora_adapters": ""}
    httpx.post(f"{url}/sim/faults", json={"engine_hang": True})  # requests stay in flight
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(httpx.post, f"{url}/v1/completions", timeout=60, json={
            "model": name, "prompt": "x", "max_tokens": 1}) for name in ("sql", "chat")]
        wait_for(lambda: info()["running_lora_adapters"] == "chat,sql", what="both in flight")
        sample = parse_vllm_metrics(httpx.get(f"{url}/metrics").text)
        assert sample.running is not None and sample.running + (sample.waiting or 0) == 2
        httpx.post(f"{url}/sim/faults", json={"engine_hang": False})
        assert [r.result().status_code for r in replies] == [200, 200]
    assert info()["running_lora_adapters"] == ""
