"""vLLM's audio routes through kvgate: ``/v1/audio/transcriptions`` and ``translations``, a
multipart/form-data upload, with the official openai client. The form's ``model`` is read
and becomes the served name, the other parts (the WAV file) reach the replica as sent, a
client's ``cache_salt`` part never does; a form without a model, a broken form, a JSON body
and a non-JSON answer format are OpenAI-shaped 400s; the in-flight count comes back to 0. A
real gateway (authentication on) before one simulated replica."""

from __future__ import annotations

import io
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import inflight, two_tier_gateway, wait_for

ADMIN = "routes-audio-admin-0123456789"


def _wav() -> bytes:
    """A tenth of a second of 16 kHz mono silence."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x00" * 1600)
    return out.getvalue()


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _last(sim: str) -> dict[str, Any]:
    sent: dict[str, Any] = httpx.get(f"{sim}/sim/requests", params={"n": 1}).json()[
        "requests"][0]
    return sent


def test_the_sdks_transcription_and_translation(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=keys["default"], max_retries=0)
    audio = _wav()
    httpx.delete(f"{keys['sim']}/sim/requests")
    got = client.audio.transcriptions.create(model="open", file=("a.wav", audio),
                                             extra_body={"cache_salt": "not-mine"})
    assert got.text == f"simulated speech of {len(audio)} bytes"
    sent = _last(keys["sim"])
    assert sent["path"] == "/v1/audio/transcriptions"
    assert sent["body"]["model"] == "sim-model" and "cache_salt" not in sent["body"]
    assert int(sent["body"]["file"]) == len(audio)  # the file's bytes as sent
    out = client.audio.translations.create(model="open", file=("a.wav", audio))
    assert out.text.startswith("simulated speech")
    assert _last(keys["sim"])["path"] == "/v1/audio/translations"
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def _form(boundary: str, *parts: tuple[str, bytes]) -> bytes:
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{n}"\r\n\r\n'
                    .encode() + v + b"\r\n" for n, v in parts)
    return body + f"--{boundary}--\r\n".encode()


@pytest.mark.parametrize(("content_type", "body", "param"), [
    ("multipart/form-data; boundary=XyZ", _form("XyZ", ("file", b"RIFF")), "model"),
    ("multipart/form-data; boundary=XyZ", b"--XyZ\r\nno headers here", None),  # unclosed
    ("multipart/form-data", _form("XyZ", ("model", b"open")), None),  # no boundary
    ("application/json", b'{"model": "open"}', None),
    ("application/x-www-form-urlencoded", b"model=open&file=x", None),  # not an upload
    ("multipart/form-data; boundary=XyZ",
     _form("XyZ", ("model", b"open"), ("response_format", b"srt")), "response_format"),
])
def test_bad_forms_are_openai_shaped_400s(
    gw: tuple[str, dict[str, str]], content_type: str, body: bytes, param: str | None,
) -> None:
    base, keys = gw
    answer = httpx.post(f"{base}/v1/audio/transcriptions", content=body, timeout=30,
                        headers={"Authorization": f"Bearer {keys['default']}",
                                 "Content-Type": content_type})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param
    assert param is not None or "multipart/form-data" in error["message"]
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_an_unknown_model_in_the_form_is_a_404(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=keys["default"], max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.audio.transcriptions.create(model="gold-only", file=("a.wav", _wav()))
    assert err.value.code == "model_not_found"
