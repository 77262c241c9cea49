"""A streamed transcription as the OpenAI Node SDK (openai 6.49, undici's FormData) sends it.

`client.audio.transcriptions.create({model, file, stream: true})` in Node posts a multipart
form whose `stream` part is the text `true`, with `accept: application/json`. vLLM answers it
as an event stream of `transcription.chunk` events and `data: [DONE]`; the simulator answered
it whole, so kvgate (which reads `stream` from the form) refused the replica's answer with a
502 "not the stream asked for", and the SDK raised `InternalServerError`. Here the same bytes
go through a real gateway (authentication on) before one simulated replica.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.gateway import inflight, two_tier_gateway, wait_for

ADMIN = "clients6-audio-admin-0123456789"
BOUNDARY = "----formdata-undici-077296730516"  # undici's own boundary form, as captured


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _undici_form(*fields: tuple[str, str]) -> bytes:
    """The parts in the order and shape undici wrote them: text fields, then the file."""
    out = b""
    for name, value in fields:
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n"
                f"{value}\r\n").encode()
    out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"x.wav\"\r\nContent-Type: audio/wav\r\n\r\nabcdef\r\n"
            f"--{BOUNDARY}--\r\n").encode()
    return out


def _events(text: str) -> list[bytes]:
    return [block[len("data: "):].encode() for block in text.split("\n\n")
            if block.startswith("data: ")]


@pytest.mark.parametrize(("route", "kind"), [
    ("transcriptions", "transcription"), ("translations", "translation")])
def test_node_sdk_streamed_transcription_is_an_event_stream(
        gw: tuple[str, dict[str, str]], route: str, kind: str) -> None:
    base, keys = gw
    body = _undici_form(("model", "open"), ("stream", "true"), ("stream_include_usage", "true"))
    headers = {"authorization": f"Bearer {keys['default']}", "accept": "application/json",
               "content-type": f"multipart/form-data; boundary={BOUNDARY}",
               "user-agent": "OpenAI/JS 6.49.0", "x-stainless-lang": "js"}
    answer = httpx.post(f"{base}/v1/audio/{route}", content=body, headers=headers, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = _events(answer.text)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["object"] == f"{kind}.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]]
    assert "".join(deltas) == "simulated speech of 6 bytes"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_node_sdk_unstreamed_transcription_stays_whole(gw: tuple[str, dict[str, str]]) -> None:
    """`stream: false` reaches the form as the text `false`: a whole JSON answer, as before."""
    base, keys = gw
    answer = httpx.post(
        f"{base}/v1/audio/transcriptions",
        content=_undici_form(("model", "open"), ("stream", "false")),
        headers={"authorization": f"Bearer {keys['default']}",
                 "content-type": f"multipart/form-data; boundary={BOUNDARY}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.json()["text"] == "simulated speech of 6 bytes"
