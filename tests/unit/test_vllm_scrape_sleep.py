"""`vllm:engine_sleep_state` as vLLM 0.34 exports it (one series per engine and state), read
into `Sample.asleep`: one engine asleep is the replica asleep; no such gauge, no reading."""

from __future__ import annotations

import pytest

from gateway.scrape import parse_vllm_metrics

RUNNING = 'vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.0\n'


def _states(*awake: float) -> str:
    lines = ["# TYPE vllm:engine_sleep_state gauge"]
    for engine, value in enumerate(awake):
        for state, v in (("awake", value), ("weights_offloaded", 1.0 - value),
                         ("discard_all", 0.0)):
            lines.append(f'vllm:engine_sleep_state{{engine="{engine}",model_name='
                         f'"meta-llama/Llama-3.1-8B",sleep_state="{state}"}} {v}')
    return RUNNING + "\n".join(lines) + "\n"


@pytest.mark.parametrize(("awake", "asleep"), [
    ((1.0,), False), ((0.0,), True), ((1.0, 1.0), False), ((1.0, 0.0), True),
])
def test_sleep_state(awake: tuple[float, ...], asleep: bool) -> None:
    assert parse_vllm_metrics(_states(*awake)).asleep is asleep


def test_no_sleep_gauge_is_no_reading() -> None:
    assert parse_vllm_metrics(RUNNING).asleep is None
