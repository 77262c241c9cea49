"""`kvgate sim --lora-modules` serves LoRA adapters as a vLLM replica started with
`--enable-lora` does: a card per adapter with the base model as `parent`, requests naming it
answered under its name, its KV cache its own (vLLM hashes the LoRA name into the first block),
and adapters loaded and unloaded at run time. A real simulator process, the openai client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai

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
