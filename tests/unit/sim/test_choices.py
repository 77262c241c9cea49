"""`n > 1` in process: one `Generation` serving n sequences on a real engine runner."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import orjson

from loadtest.sim.chat_format import ChatFormat
from loadtest.sim.costmodel import CostModel
from loadtest.sim.engine import Engine
from loadtest.sim.faults import Faults
from loadtest.sim.generate import Generation, ServeContext
from loadtest.sim.parse import parse_generation
from loadtest.sim.runner import EngineRunner
from loadtest.sim.spec import EngineConfig

COST = CostModel(step_overhead_s=0.001, prefill_token_s=1e-5, decode_seq_s=1e-4,
                 kv_read_token_s=1e-8)
PROMPT = "a shared prompt of several blocks " * 20


async def _serve(body: dict[str, Any]) -> tuple[list[bytes], Engine]:
    engine = Engine(EngineConfig(cost=COST, num_gpu_blocks=1000, block_size=16,
                                 max_model_len=4096))
    runner = EngineRunner(engine, time_scale=1000.0)
    task = asyncio.create_task(runner.run())
    gen = parse_generation(body, False, 4096)
    generation = Generation(ServeContext(Faults(), "m", 16), runner, gen, "r", [])
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        return {}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message.get("body", b""))

    await generation.serve(receive, send, ChatFormat(generation, "cmpl-r"))
    task.cancel()
    return sent, engine


def test_whole_answer_has_n_choices_and_the_usage_of_all() -> None:
    body = {"model": "m", "prompt": PROMPT, "n": 3, "max_tokens": 4, "ignore_eos": True}
    sent, engine = asyncio.run(_serve(body))
    answer = orjson.loads(b"".join(sent))
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(len(c["text"]) == 16 and c["finish_reason"] == "length"
               for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 12
    stats = engine.stats
    assert stats.generation_tokens == 12
    full_blocks = (answer["usage"]["prompt_tokens"] - 1) // 16
    assert stats.prefix_cache_hits == 2 * full_blocks * 16  # the prompt computed once


def test_stream_carries_each_choice_index_to_its_finish() -> None:
    body = {"model": "m", "prompt": PROMPT, "n": 2, "max_tokens": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, _ = asyncio.run(_serve(body))
    events = [e for e in b"".join(sent).split(b"\n\n") if e.startswith(b"data: {")]
    chunks = [orjson.loads(e[6:]) for e in events]
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert b"".join(sent).endswith(b"data: [DONE]\n\n")


def test_a_batch_computes_each_prompt_once() -> None:
    other = "another prompt that shares nothing " * 20
    body = {"model": "m", "prompt": [PROMPT, other], "n": 2, "max_tokens": 2,
            "ignore_eos": True}
    sent, engine = asyncio.run(_serve(body))
    answer = orjson.loads(b"".join(sent))
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert answer["usage"]["completion_tokens"] == 8
    prompts = parse_generation(body, False, 4096).prompts
    assert answer["usage"]["prompt_tokens"] == sum(p.num_tokens for p in prompts)
    hits = sum((p.num_tokens - 1) // 16 * 16 for p in prompts)  # each prompt's second sequence
    assert engine.stats.prefix_cache_hits == hits


def test_n_sequences_are_admitted_together_and_share_the_prompt_in_that_step() -> None:
    body = {"model": "m", "prompt": PROMPT, "n": 3, "max_tokens": 4, "ignore_eos": True}
    _, engine = asyncio.run(_serve(body))
    prompt = parse_generation(body, False, 4096).prompt.num_tokens
    stats = engine.stats
    # one step prefills the three (vLLM V1 caches the first one's full blocks when it
    # schedules them), three more decode them
    assert stats.steps == 4
    assert stats.prefill_tokens_computed == prompt + 2 * (prompt - (prompt - 1) // 16 * 16)
