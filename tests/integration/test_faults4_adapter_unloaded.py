"""A LoRA adapter unloaded from every replica that listed it, with no try left for the one
that still seems to hold it: the client gets the replica's 404 "The model `sql` does not
exist." (the SDK's `NotFoundError`, not retried), not a 502 the SDKs retry twice.

Before: the try found the adapter gone there (`Pool.unloaded`), saw another replica still
listed with it and raised "The replica no longer serves this LoRA adapter." to try that one;
on the last try (here `upstream.max_attempts: 1`; with the default 3, a pool of four replicas
holding it) that error was the answer, a 502. Real gateway, two simulated replicas, the
official client."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc


@pytest.mark.parametrize("stream", [False, True])
def test_an_adapter_gone_everywhere_is_the_replicas_404(
    sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc], stream: bool,
) -> None:
    urls = [sim_factory("--time-scale", "50", "--lora-modules", "sql=/adapters/sql",
                        model="base")[1] for _ in range(2)]
    gw, base = gateway_proc(upstreams=urls, env={"KVGATE_UPSTREAM__MAX_ATTEMPTS": "1"})
    procs.append(gw.start())
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    wait_for(lambda: "sql" in {m.id for m in client.models.list()}, timeout=30,
             what="the adapter listed")
    for url in urls:  # unloaded everywhere, before kvgate reads the replicas' cards again
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"},
                          timeout=10).status_code == 200
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=stream)
    assert "does not exist" in caught.value.message
    # neither replica is charged: an adapter gone is the request's model, not a fault
    assert sum(metric_values(base, "kvgate_replica_failures_total").values()) == 0
    assert sum(metric_values(base, "kvgate_inflight_requests").values()) == 0
    reply = client.chat.completions.create(  # the base model serves on
        model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.model == "base"
