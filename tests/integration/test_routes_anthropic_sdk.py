"""The official Anthropic Python SDK against kvgate's ``/v1/messages``, as a coding agent
pointed at vLLM through kvgate uses it: a message whole and streamed (its events parsed by
the SDK), count_tokens, and kvgate's own errors raised as the SDK's typed exceptions. A real
gateway (authentication on) before one simulated replica. The SDK is a test dependency
(pyproject's ``test`` extra, installed by scripts/setup); a venv made before it was added
skips these until set up again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.sim.extra_routes import CUT_MID_STREAM
from tests.support.gateway import inflight, two_tier_gateway, wait_for

anthropic: Any = pytest.importorskip("anthropic", reason="run scripts/setup (test extra)")

ADMIN = "routes-anthropic-admin-0123456789"
TURNS = [{"role": "user", "content": "Summarise the change."}]


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _client(base: str, key: str) -> Any:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0)


def test_a_message_whole_and_streamed(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    client = _client(base, keys["default"])
    httpx.delete(f"{keys['sim']}/sim/requests")
    msg = client.messages.create(model="open", max_tokens=4, system="Be brief.",
                                 messages=TURNS)
    assert msg.role == "assistant" and msg.content[0].text == "w0 w1 w2 w3"
    assert msg.usage.output_tokens == 4
    sent = httpx.get(f"{keys['sim']}/sim/requests", params={"n": 1}).json()["requests"][0]
    assert sent["body"]["cache_salt"] and sent["body"]["model"] == "sim-model"
    with client.messages.stream(model="open", max_tokens=3, messages=TURNS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "w0 w1 w2"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    count = client.messages.count_tokens(model="open", messages=TURNS)
    assert count.input_tokens > 0
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_kvgates_errors_are_the_sdks_typed_exceptions(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    with pytest.raises(anthropic.AuthenticationError):
        _client(base, "sk-not-a-key").messages.create(model="open", max_tokens=2,
                                                      messages=TURNS)
    with pytest.raises(anthropic.NotFoundError) as err:
        _client(base, keys["default"]).messages.create(model="gold-only", max_tokens=2,
                                                       messages=TURNS)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_a_stream_cut_mid_way_raises_in_the_sdk(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    client = _client(base, keys["default"])
    with pytest.raises(anthropic.APIStatusError) as err, client.messages.stream(
            model="open", max_tokens=5, messages=TURNS,
            metadata={"user_id": CUT_MID_STREAM}) as stream:
        for _ in stream.text_stream:  # (raised at the error event)
            pass
    assert "mid-stream" in str(err.value)
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
