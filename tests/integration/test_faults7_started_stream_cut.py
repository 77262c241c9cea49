"""A stream that already sent its client tokens, on a replica that then freezes (SIGSTOP) or
whose engine hangs, ends once kvgate finds that replica frozen or stalled -- with kvgate's 504
error event ("The replica stopped making progress ...") and the stream's end, in OpenAI's
shape or, on ``/v1/messages``, Anthropic's ``event: error`` -- its lease released. Before,
such a stream ran on until `upstream.idle_timeout_s` (2 minutes by default; 20 s here) and
ended with the idle timeout's event: the assertions on the message fail then. A replica
answering `/health` late while it streams is alive: its stream runs to its end.

Real gateway, simulated replicas (slow decode: `--time-scale 0.2`), the official clients.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.gateway import gateway_proc, inflight, request_statuses, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
STALLED = "stopped making progress"
# fast health (tests/support's FAST_HEALTH: 0.2 s probes, 0.5 s timeout); the idle timeout
# shortened so the old behaviour fails in 20 s, not 2 minutes
ENV = {"KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "20", "KVGATE_HEALTH__STALL_AFTER_S": "2"}
TURN: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a long story"}]
LONG = {"ignore_eos": True}  # (the simulator's answers stop at 8-128 tokens otherwise)
# a hung vLLM engine's /metrics: a request running, its token counters standing still
HUNG_PAGE = (b'vllm:num_requests_running{model_name="sim-model"} 1\n'
             b'vllm:num_requests_waiting{model_name="sim-model"} 0\n'
             b'vllm:generation_tokens_total{model_name="sim-model"} 100\n'
             b'vllm:prompt_tokens_total{model_name="sim-model"} 10\n')


@pytest.fixture
def stack() -> Iterator[tuple[Proc, str, str]]:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "0.2", model=MODEL)
        procs.append(sim.start())
        gw, base = gateway_proc(upstreams=[url], env=ENV)
        procs.append(gw.start())
        yield sim, url, base
    finally:
        for p in reversed(procs):
            p.signal(signal.SIGCONT)
            p.stop()


def _read_after_fault(stream: Any, fault: Any) -> tuple[int, str]:
    """Read `stream` (an openai.Stream); call `fault` after its third chunk. Returns the
    chunks read and the error the client raised ("" if none)."""
    n = 0
    try:
        for _ in stream:
            n += 1
            if n == 3:
                fault()
    except openai.APIError as exc:
        return n, str(exc)
    return n, ""


def test_a_frozen_replicas_started_stream_ends_with_an_error_event(
    stack: tuple[Proc, str, str],
) -> None:
    sim, _, base = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=TURN, max_tokens=2000,
                                            stream=True, extra_body=LONG)
    n, error = _read_after_fault(stream, lambda: sim.signal(signal.SIGSTOP))
    assert n >= 3 and STALLED in error, error
    assert inflight(base) == 0  # its lease given back (the replica is still stopped)
    assert request_statuses(base).get("504") == 1


def test_a_hung_engines_started_stream_ends_when_it_is_found_stalled(
    stack: tuple[Proc, str, str],
) -> None:
    _, url, base = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=TURN, max_tokens=2000,
                                            stream=True, extra_body=LONG)
    n, error = _read_after_fault(
        stream, lambda: httpx.post(f"{url}/sim/faults", json={"engine_hang": True}))
    assert n >= 3 and STALLED in error, error
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def test_the_anthropic_route_ends_with_anthropics_error_event() -> None:
    """On ``/v1/messages`` the same end is Anthropic's ``event: error`` (the SDK raises its
    typed error). The replica (a scripted one: the simulator's Anthropic route is no engine's)
    sends three text deltas, then nothing, while its /metrics say a request runs and its token
    counters stand still: a hung engine, found stalled."""
    anthropic: Any = pytest.importorskip("anthropic", reason="run scripts/setup (test extra)")
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 0}}}
    events = [_event("message_start", start), _event("content_block_start", {
        "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})]
    events += [_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": f"w{i} "}})
               for i in range(3)]
    with BadReplica(MODEL) as replica:
        replica.pages[b"/metrics"] = HUNG_PAGE
        replica.answer = sse_head() + chunked(*events, last=False)
        replica.rest = chunked(b"", last=True)  # (sent once the test is over)
        gw, base = gateway_proc(upstreams=[replica.url], env=ENV)
        try:
            with gw:
                client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0,
                                             timeout=60)
                texts: list[str] = []
                with pytest.raises(anthropic.APIStatusError) as err, client.messages.stream(
                        model=MODEL, max_tokens=2000, messages=TURN) as stream:
                    for text in stream.text_stream:
                        texts.append(text)
                assert texts == ["w0 ", "w1 ", "w2 "]
                assert STALLED in str(err.value)
                assert err.value.body["type"] == "error"  # Anthropic's error event
                wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
        finally:
            replica.gate.set()


def test_a_replica_slow_to_answer_health_while_it_streams_is_not_cut(
    stack: tuple[Proc, str, str],
) -> None:
    _, url, base = stack
    # every /health answer comes after several probe timeouts (0.5 s) while it streams
    httpx.post(f"{url}/sim/faults", json={"health_latency_ms": 3000})
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=MODEL, messages=TURN, max_tokens=300, stream=True, extra_body=LONG,
        stream_options={"include_usage": True})
    chunks = list(stream)  # (no error event: the client raises none)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 300
    assert request_statuses(base) == {"200": 1.0}
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
