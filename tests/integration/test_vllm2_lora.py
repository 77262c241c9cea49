"""LoRA adapters behind kvgate. vLLM replicas started with `--enable-lora` list their adapters
in `/v1/models` (a card whose `parent` is the base model); a request naming an adapter must
reach a replica that has it loaded, under the adapter's name (its KV is not the base model's).
kvgate lists the adapters in its own `/v1/models`, routes an adapter's requests to the replicas
listing it only, and sees an adapter loaded at run time (`/v1/load_lora_adapter`) at its next
read of the replicas' cards. Real gateway and simulated replicas, the openai client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def _ask(client: openai.OpenAI, model: str, text: str) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=2)
    assert raw.parse().model == model
    return raw.headers["x-kvgate-replica"].split("/", 1)[1]


def _models_seen(url: str) -> list[Any]:
    return [r["body"]["model"] for r in httpx.get(f"{url}/sim/requests").json()["requests"]
            if r["path"] == "/v1/chat/completions"]


def test_adapter_requests_go_where_it_is_loaded(sim_factory: SimFactory) -> None:
    _, with_sql = sim_factory("--time-scale", "50", "--lora-modules", "sql=/adapters/sql",
                              model="base")
    _, without = sim_factory("--time-scale", "50", "--enable-lora", model="base")
    gw, base = gateway_proc(upstreams=[with_sql, without])
    with gw:
        wait_for(lambda: "sql" in [m.id for m in _client(base).models.list().data],
                 what="the adapter listed")
        client = _client(base)
        cards = {c["id"]: c for c in httpx.get(f"{base}/v1/models").json()["data"]}
        assert (cards["sql"]["parent"], cards["base"]["parent"]) == ("base", None)
        unnamed = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert unnamed.status_code == 200 and unnamed.json()["model"] == "base"  # as vLLM's
        hosts = {_ask(client, "sql", f"question {i} " * 20) for i in range(8)}
        assert hosts == {with_sql.removeprefix("http://")}
        assert _models_seen(with_sql) == ["sql"] * 8  # sent under its name, not the base's
        assert _models_seen(without) == []
        # loaded at run time on the other replica: routed there after the next cards' read
        loaded = httpx.post(f"{without}/v1/load_lora_adapter",
                            json={"lora_name": "chat2", "lora_path": "/adapters/chat2"})
        assert loaded.status_code == 200
        wait_for(lambda: "chat2" in [m.id for m in client.models.list().data], timeout=30,
                 what="the adapter loaded at run time listed")
        assert _ask(client, "chat2", "hello there " * 20) == without.removeprefix("http://")


def test_a_models_entry_naming_an_adapter_keeps_its_name(sim_factory: SimFactory) -> None:
    _, with_sql = sim_factory("--time-scale", "50", "--lora-modules", "sql=/adapters/sql",
                              model="base")
    _, without = sim_factory("--time-scale", "50", model="base")
    config = {"pools": {"p": {"served_model": "base", "replicas": [with_sql, without]}},
              "models": {"base": {"default": "p"}, "sql": {"default": "p"}}}
    gw, base = gateway_proc(config=config)
    with gw:
        client = _client(base)
        # (an adapter is learnt at the replica's first cards' read: until then it is the base)
        wait_for(lambda: _ask_raw(client, "sql")["model"] == "sql", timeout=30,
                 what="the adapter learnt")
        httpx.delete(f"{with_sql}/sim/requests")
        for i in range(6):
            assert _ask(client, "sql", f"another question {i} " * 20) == with_sql.removeprefix(
                "http://")
        assert _models_seen(with_sql) == ["sql"] * 6  # not rewritten to the base model


def _ask_raw(client: openai.OpenAI, model: str) -> dict[str, Any]:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "probe " * 20}], max_tokens=1)
    return {"model": reply.model}


def test_an_adapter_unloaded_on_a_replica_does_not_eject_it(sim_factory: SimFactory) -> None:
    """vLLM answers a request for an adapter it unloaded 404 "The model `sql` does not exist",
    the answer of a replica serving another model, which kvgate takes out at once: one
    client's request for the adapter took a replica serving the base model well out of the
    pool (for 30 s here: the ejection's back-off). Now the adapter is forgotten there, the
    request answered by the replica that still has it, the replica left in."""
    urls = [sim_factory("--time-scale", "50", "--lora-modules", "sql=/adapters/sql",
                        model="base")[1] for _ in range(2)]
    gone, kept = urls
    gw, base = gateway_proc(upstreams=urls, env={"KVGATE_HEALTH__EJECT_BASE_S": "30",
                                                  "KVGATE_HEALTH__EJECT_MAX_S": "30"})
    with gw:
        client = _client(base)
        wait_for(lambda: "sql" in [m.id for m in client.models.list().data], what="sql listed")
        assert httpx.post(f"{gone}/v1/unload_lora_adapter",
                          json={"lora_name": "sql"}).status_code == 200
        httpx.delete(f"{gone}/sim/requests")
        for i in range(40):  # until one is sent where it was unloaded: answered by the other
            assert _ask(client, "sql", f"question {i} " * 20) == kept.removeprefix("http://")
            if _models_seen(gone):
                break
        assert _models_seen(gone) == ["sql"]
        healthy = metric_values(base, "kvgate_replica_healthy")
        assert [v for k, v in healthy.items() if gone.removeprefix("http://") in k] == [1.0]
        hosts = {_ask(client, "sql", f"again {i} " * 20) for i in range(4)}
        assert hosts == {kept.removeprefix("http://")}  # not sent there again
        # unloaded everywhere: vLLM's 404 for it, never the base model's answer under its name
        httpx.post(f"{kept}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        for i in range(2):
            reply = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
                "model": "sql", "max_tokens": 1,
                "messages": [{"role": "user", "content": f"last {i} " * 20}]})
            assert reply.status_code == 404, reply.text
            assert reply.json()["error"]["message"].startswith("The model `sql` does not exist")
        healthy = metric_values(base, "kvgate_replica_healthy")
        assert sorted(healthy.values()) == [1.0, 1.0]


def test_an_adapter_never_spills_to_a_pool_without_it(sim_factory: SimFactory) -> None:
    """Its home pool down, a tier's spill-over sent an adapter's request to a pool serving the
    base model only, rewritten to the base model's name: the base model answered it, under
    the adapter's name. Now the request waits for its pool (the pool's 503, Retry-After)."""
    _, home = sim_factory("--time-scale", "50", "--lora-modules", "sql=/adapters/sql",
                          model="base")
    _, other = sim_factory("--time-scale", "50", model="base")
    config = {"pools": {"home": {"served_model": "base", "replicas": [home]},
                        "other": {"served_model": "base", "replicas": [other]}},
              "models": {"sql": {"default": "home"}},
              "tiers": {"default": {"spill_to": "other"}}}
    gw, base = gateway_proc(config=config)
    with gw:
        client = _client(base)
        wait_for(lambda: _ask_raw(client, "sql")["model"] == "sql", timeout=30,
                 what="the adapter learnt")
        assert httpx.post(f"{home}/sim/faults", json={"dead": True}).status_code == 200
        wait_for(lambda: metric_values(base, "kvgate_replica_healthy").get(
            f'{{pool="home",replica="{home.removeprefix("http://")}"}}') == 0.0,
            what="the home replica out")
        httpx.delete(f"{other}/sim/requests")
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
            "model": "sql", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 503, reply.text
        assert _models_seen(other) == []
