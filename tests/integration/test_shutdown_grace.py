"""SIGTERM with streams that outlive `server.shutdown_grace_s`: at the end of the grace period
each stream ends with an SSE error event and `data: [DONE]` (not a cut connection), is logged
as interrupted (status 503, route "interrupted"), and the process exits with status 0."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
MODEL = "sim-model"


def test_streams_past_the_grace_period_end_with_an_error_event(sim_factory: SimFactory) -> None:
    # the replica sends 3 tokens, then nothing until the client leaves: a stream that would
    # outlive any grace period
    _, sim = sim_factory("--time-scale", "50", "--hang-after-tokens", "3")
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_SERVER__SHUTDOWN_GRACE_S": "1",
                                                  "KVGATE_SERVER__LOG_LEVEL": "info"})
    with gw:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        sdk_stream = client.completions.create(model=MODEL, prompt="y", max_tokens=50,
                                               stream=True)
        first = next(iter(sdk_stream))
        assert first.choices[0].text
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            gw.signal(signal.SIGTERM)
            events = [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        error = orjson.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        try:
            for _ in sdk_stream:
                pass
            raise AssertionError("the SDK stream ended without the error event")
        except openai.APIError as exc:  # the SDK raises on an error event in a stream
            assert "shutting down" in exc.message
        assert gw.popen is not None and gw.popen.wait(15) == 0
        records: list[dict[str, Any]] = [
            orjson.loads(line) for line in gw.output().splitlines()
            if line.startswith("{") and '"msg":"request"' in line]
    interrupted = [r for r in records if r["route"] == "interrupted"]
    assert len(interrupted) == 2 and all(r["status"] == 503 for r in interrupted)
