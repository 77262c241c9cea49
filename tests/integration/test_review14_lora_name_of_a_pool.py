"""A LoRA adapter named as another pool's base model: a request without `model` left that
pool's model out of the ones the key can use (every adapter name was), so with two pools --
`base` (whose replica also loads an adapter `other`) and `other` -- it went to `base`
silently instead of the 400 asking which of the two. Real gateway, simulated replicas."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc


@contextmanager
def _two_pools(sim_factory: Callable[..., tuple[Proc, str]]) -> Iterator[str]:
    """A gateway over pool `a` (model `base`, its replica loading an adapter `other`) and
    pool `b` (model `other`), once both serve and the adapter is learnt: its base URL."""
    _, with_adapter = sim_factory("--time-scale", "50", "--lora-modules", "other=/adapters/o",
                                  model="base")
    _, other = sim_factory("--time-scale", "50", model="other")
    config = {"pools": {"a": {"served_model": "base", "replicas": [with_adapter]},
                        "b": {"served_model": "other", "replicas": [other]}}}
    gw, base = gateway_proc(config=config)
    with gw:
        def adapter_learnt() -> bool:
            reply = httpx.post(f"{base}/v1/completions", timeout=30, json={
                "model": "base", "prompt": "x", "max_tokens": 1})
            # (learnt at the replica's first cards' read, with its base model)
            return reply.status_code == 200 and "other" in [
                m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]

        wait_for(adapter_learnt, timeout=30, what="both pools up, the adapter learnt")
        wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 200, timeout=30,
                 what="ready")
        yield base


def test_a_pool_model_named_as_an_adapter_is_still_offered(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    with _two_pools(sim_factory) as base:
        unnamed = httpx.post(f"{base}/v1/completions", timeout=30,
                             json={"prompt": "x", "max_tokens": 1})
        assert unnamed.status_code == 400, unnamed.text
        error = unnamed.json()["error"]
        assert error["param"] == "model" and "2 models" in error["message"], error


def test_a_pool_model_named_as_an_adapter_reaches_its_pool(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    """A request naming `other` (pool b's base model, also an adapter of pool a's replica)
    was a 404 "does not exist": the planner took it for an adapter loaded nowhere in b."""
    with _two_pools(sim_factory) as base:
        reply = httpx.post(f"{base}/v1/completions", timeout=30,
                           json={"model": "other", "prompt": "x", "max_tokens": 1})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-kvgate-replica"].startswith("b/")
