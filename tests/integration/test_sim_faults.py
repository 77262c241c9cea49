"""`kvgate sim` fault switches, auth, legacy shapes and client-disconnect aborts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def _client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met before the deadline")


def _stats(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{url}/sim/stats").json()
    return stats


def test_disconnect_aborts_and_frees_blocks(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "1")
    body = {"model": MODEL, "prompt": "long " * 100, "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert _stats(url)["running"] == 1
    _wait_for(lambda: _stats(url)["aborted"] == 1)
    stats = _stats(url)
    assert stats["running"] == 0 and stats["kv_usage"] == 0.0
    text = httpx.get(f"{url}/metrics").text
    aborted = [s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total"
               and s.labels["finished_reason"] == "abort"]
    assert aborted == [1.0]


@pytest.mark.parametrize(("status", "exc"), [(500, openai.InternalServerError),
                                             (503, openai.APIStatusError)])
def test_error_rate(sim_factory: SimFactory, status: int,
                    exc: type[openai.APIStatusError]) -> None:
    _, url = sim_factory("--error-rate", "1", "--error-status", str(status))
    with pytest.raises(exc) as info:
        _client(url).chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)
    assert info.value.status_code == status
    httpx.post(f"{url}/sim/faults", json={"error_rate": 0.0}).raise_for_status()
    _client(url).chat.completions.create(model=MODEL, messages=MSG, max_tokens=1)


def test_admission_limit_503_busy(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "1", "--max-num-queued-reqs", "1")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as resp:
        lines = resp.iter_lines()  # keep a reference: a dropped generator closes the stream
        next(lines)
        with pytest.raises(openai.APIStatusError) as info:
            _client(url).completions.create(model=MODEL, prompt="y", max_tokens=1)
    assert info.value.status_code == 503
    assert "currently busy" in info.value.message
    assert _stats(url)["admission_rejections"] == 1


DEAD_BODY = {"error": {"message": "The server had an error while processing your request.",
                       "type": "InternalServerError", "param": None, "code": 500}}


def test_dead_switch(sim_factory: SimFactory) -> None:
    _, url = sim_factory()
    assert httpx.get(f"{url}/health").status_code == 200
    faults = httpx.post(f"{url}/sim/faults", json={"dead": True}).json()
    assert faults["dead"] is True
    assert httpx.get(f"{url}/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as info:  # vLLM's EngineDeadError: a 500
        _client(url).completions.create(model=MODEL, prompt="y", max_tokens=1)
    assert info.value.status_code == 500
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert (r.status_code, r.json()) == (500, DEAD_BODY)
    httpx.post(f"{url}/sim/faults", json={"dead": False})
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("chat", [True, False])
def test_dead_engine_ends_running_streams_with_an_error_event(sim_factory: SimFactory,
                                                              chat: bool) -> None:
    _, url = sim_factory("--time-scale", "1")
    path, fields = (("/v1/chat/completions", {"messages": MSG}) if chat
                    else ("/v1/completions", {"prompt": "x"}))
    body = {"model": MODEL, "max_tokens": 2000, "ignore_eos": True, "stream": True, **fields}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        assert '"choices"' in next(line for line in lines if line.startswith("data: "))
        httpx.post(f"{url}/sim/faults", json={"dead": True}).raise_for_status()
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:]) == DEAD_BODY
    assert resp.status_code == 200


def test_dead_engine_fails_a_waiting_non_streamed_request(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "0.05")  # slow: the request is still running

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=10) as client:
            pending = asyncio.ensure_future(client.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True}))
            while (await client.get(f"{url}/sim/stats")).json()["running"] == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            await client.post(f"{url}/sim/faults", json={"dead": True})
            return await pending

    r = asyncio.run(scenario())
    assert (r.status_code, r.json()) == (500, DEAD_BODY)


def test_drop_connections_closes_streams_without_an_answer(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "1")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with pytest.raises(httpx.RemoteProtocolError), httpx.stream(
        "POST", f"{url}/v1/completions", json=body, timeout=10
    ) as resp:
        lines = resp.iter_lines()
        next(lines)
        httpx.post(f"{url}/sim/faults", json={"drop_connections": True}).raise_for_status()
        rest = list(lines)
        raise AssertionError(f"the stream ended cleanly: {rest[-2:]}")
    assert httpx.get(f"{url}/health").status_code == 200  # the process is still up


def test_engine_faulted_answers_503_while_health_stays_200(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--engine-faulted")
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == 503 and "EngineFaultedError" in err["message"]
    httpx.post(f"{url}/sim/faults", json={"engine_faulted": False}).raise_for_status()
    _client(url).completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_hang_after_tokens(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--time-scale", "50", "--hang-after-tokens", "2")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    data: list[str] = []
    with pytest.raises(httpx.ReadTimeout), httpx.stream(
        "POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=1.0)
    ) as resp:
        data.extend(line for line in resp.iter_lines() if line.startswith("data: "))
    assert data and not any("[DONE]" in line for line in data)
    chunks = [json.loads(line[6:]) for line in data]
    assert len("".join(c["choices"][0]["text"] for c in chunks)) == 8  # exactly two tokens
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_fault_endpoint_validates(sim_factory: SimFactory) -> None:
    _, url = sim_factory()
    assert httpx.post(f"{url}/sim/faults", json={"nope": 1}).status_code == 400
    assert httpx.post(f"{url}/sim/faults", json={"error_status": 418}).status_code == 400
    assert httpx.get(f"{url}/sim/faults").json()["error_status"] == 500


def test_api_key(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--api-key", "secret")
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
    with pytest.raises(openai.AuthenticationError):
        _client(url, "wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    _client(url, "secret").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert httpx.get(f"{url}/metrics").status_code == 200  # not under /v1


def test_legacy_errors_and_metrics(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--legacy-errors", "--metrics-compat", "legacy")
    r = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    assert r.json() == {"object": "error", "message": "The model `nope` does not exist.",
                        "type": "NotFoundError", "param": "model", "code": 404}
    with pytest.raises(openai.NotFoundError):
        _client(url).completions.create(model="nope", prompt="x", max_tokens=1)
    names = {f.name for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    assert {"vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries",
            "vllm:gpu_prefix_cache_hits", "vllm:time_per_output_token_seconds"} <= names
    assert "vllm:kv_cache_usage_perc" not in names
