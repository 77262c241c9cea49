"""A prompt too long for every replica of its tier's home pool goes to the tier's spill-over
pool when that one's context takes it. It went home anyway: with a home pool of 2048-token
replicas and a `spill_to` pool of 16384-token ones, a ~5,000-token prompt (or a ~1,500-token
one asking for 1,000 tokens of output) was answered vLLM's 400 "maximum context length is
2048 tokens" while the spill pool would have served it.

A real gateway in front of two pools of real simulated replicas.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


def test_a_prompt_too_long_for_home_goes_to_the_spill_pool(sim_factory: SimFactory) -> None:
    _, short = sim_factory("--time-scale", "50", "--max-model-len", "2048", model="m-short")
    _, long = sim_factory("--time-scale", "50", "--max-model-len", "16384", model="m-long")
    config = {"pools": {"home": {"served_model": "m-short", "replicas": [short]},
                        "big": {"served_model": "m-long", "replicas": [long]}},
              "models": {"llama": {"default": "home"}},
              "tiers": {"default": {"spill_to": "big"}}}
    gw, base = gateway_proc(config=config)
    with gw:
        # the home pool's context known (its card); a pool's not known yet counts as long
        wait_for(lambda: httpx.get(f"{base}/v1/models/llama").json().get(
            "max_model_len") == 2048, what="the home pool's context length learned")
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        routed: list[tuple[int, str, str]] = []
        asks = [("word " * 4000, 2),  # ~5,000 tokens
                ("word " * 1200, 1000)]  # ~1,500 tokens, and 1,000 asked for
        for i, (words, max_tokens) in enumerate(asks * 3):
            raw = c.chat.completions.with_raw_response.create(
                model="llama", max_tokens=max_tokens,
                messages=[{"role": "user", "content": f"question {i} {words}"}])
            routed.append((raw.status_code, raw.headers["x-kvgate-route"],
                           raw.headers["x-kvgate-replica"]))
        assert routed == [(200, "spill", f"big/{long.removeprefix('http://')}")] * 6
        assert metric_values(base, "kvgate_spillovers_total") == {
            '{from_pool="home",tier="default",to_pool="big"}': 6.0}
        # a prompt that fits stays home
        for i in range(4):
            raw = c.chat.completions.with_raw_response.create(
                model="llama", max_tokens=100,
                messages=[{"role": "user", "content": f"hi {i} " + "word " * 400}])
            assert raw.headers["x-kvgate-route"] != "spill"
            assert raw.headers["x-kvgate-replica"] == f"home/{short.removeprefix('http://')}"
        # too long for every pool of the tier: the home replica's own 400, as before
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(
                model="llama", max_tokens=2,
                messages=[{"role": "user", "content": "word " * 16000}])  # ~20,000 tokens
        assert "maximum context length is 2048" in refused.value.message
