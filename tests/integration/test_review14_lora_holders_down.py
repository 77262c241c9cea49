"""A LoRA adapter whose only replica is down while the pool's other replicas are up: the
503 said "No healthy replica for the model `sql` (2 replicas: 1 cannot connect, 1
available)" -- one available, yet none for the adapter. It counts the replicas that can
serve the adapter. Real gateway, simulated replicas (one stopped), the openai client."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc


def test_the_503_counts_the_adapters_replicas(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    holder, with_sql = sim_factory("--time-scale", "50", "--lora-modules",
                                   "sql=/adapters/sql", model="base")
    _, plain = sim_factory("--time-scale", "50", model="base")
    gw, base = gateway_proc(upstreams=[with_sql, plain])
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        wait_for(lambda: "sql" in [m.id for m in client.models.list().data], timeout=30,
                 what="the adapter listed")
        holder.stop()
        errors: list[openai.APIStatusError] = []

        def refused() -> bool:
            try:
                client.chat.completions.create(
                    model="sql", messages=[{"role": "user", "content": "hi " * 10}],
                    max_tokens=1)
            except openai.APIStatusError as exc:
                errors.append(exc)
                return exc.status_code == 503
            return False

        wait_for(refused, timeout=30, what="the adapter's 503")
        answer = errors[-1]
        message = answer.response.json()["error"]["message"]
        assert "`sql`" in message and "cannot connect" in message, message
        assert "available" not in message, message  # (the base model's replica is not)
        assert answer.response.headers.get("retry-after")
        ok = httpx.post(f"{base}/v1/completions", timeout=30,
                        json={"model": "base", "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200
