"""A replica whose `/metrics` cannot be read -- a proxy in front of vLLM that routes `/v1`
only answers it 404 -- is served on kvgate's own accounting, and the operator is told once,
not on every scrape, and told when it reads again. Real gateway, a simulated replica."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
WARNING = "replica's /metrics cannot be read (/metrics answered 404)"


def _scrape_errors(base: str) -> float:
    return sum(metric_values(base, "kvgate_scrape_errors_total").values())


def test_a_metrics_page_answering_404_is_warned_about_once(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    httpx.post(f"{sim}/sim/faults", json={"metrics_status": 404}).raise_for_status()
    gw, base = gateway_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [sim]}}})
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        reply = client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert reply.choices[0].text  # served all the same
        wait_for(lambda: WARNING in gw.output(None), timeout=20, what="the warning")
        seen = _scrape_errors(base)
        wait_for(lambda: _scrape_errors(base) >= seen + 5, timeout=20, what="more failures")
        assert gw.output(None).count(WARNING) == 1  # once, not per scrape
        httpx.post(f"{sim}/sim/faults", json={"metrics_status": 0}).raise_for_status()
        wait_for(lambda: "replica's /metrics read again" in gw.output(None), timeout=20,
                 what="the recovery line")
