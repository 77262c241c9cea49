"""An Anthropic agent conversation keeps its replica while its client moves the
``cache_control`` mark to the newest turn (as the Anthropic SDK's users and agent loops do):
the mark is no part of the prompt vLLM caches, so a tool_result, image or text block that
lost it since the last turn is the same prefix. A real gateway (the default `cache_aware`
policy) before two simulated replicas, the official Anthropic SDK as the client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import Proc, start_sims

MODEL = "sim-model"
LOG = "".join(f"line {n}: build step {n} finished without warnings\n" for n in range(120))
IMAGE = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo" * 300}
MARK = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    procs: list[Proc] = []
    try:
        _, urls = start_sims(procs, 2, "--time-scale", "50", model=MODEL)
        gw, url = gateway_proc(config={"pools": {"p": {"served_model": MODEL,
                                                       "replicas": urls}}})
        procs.append(gw.start())
        yield url
    finally:
        for p in reversed(procs):
            p.stop()


def _result(marked: bool) -> dict[str, Any]:
    """The first turn: a tool's output (its text in nested blocks) and a screenshot."""
    text: dict[str, Any] = {"type": "text", "text": LOG}
    image: dict[str, Any] = {"type": "image", "source": IMAGE}
    if marked:
        text, image = {**text, "cache_control": MARK}, {**image, "cache_control": MARK}
    return {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [text]}, image]}


def test_a_conversation_keeps_its_replica_as_its_cache_mark_moves(base: str) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    first = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=3, messages=[_result(marked=True)])  # type: ignore[list-item]
    home = first.headers["x-kvgate-replica"]
    turns: list[Any] = [_result(marked=False)]
    for n in range(2, 5):
        turns += [{"role": "assistant", "content": "ok"},
                  {"role": "user", "content": [{"type": "text", "text": f"Step {n}?",
                                                "cache_control": MARK}]}]
        got = client.messages.with_raw_response.create(model=MODEL, max_tokens=3,
                                                       messages=turns)
        assert got.headers["x-kvgate-route"] == "prefix-hit", n
        assert got.headers["x-kvgate-replica"] == home
        turns[-1] = {"role": "user", "content": f"Step {n}?"}  # the mark moves on
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
