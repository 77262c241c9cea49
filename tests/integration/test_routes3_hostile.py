"""Hostile and unusual input on vLLM's routes through kvgate (a real gateway, authentication
on, before one simulated replica): multipart forms whose Content-Type has a parameter ending
in "boundary" or a boundary past RFC 2046's 70 characters, a model field that is not UTF-8,
a rerank with a `top_n` that is no integer, and which key wins on /v1/messages when
``x-api-key`` and ``Authorization`` disagree. Each refusal is an OpenAI-shaped 400 and the
in-flight count comes back to 0."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.gateway import inflight, metric_values, two_tier_gateway, wait_for

ADMIN = "routes3-hostile-admin-0123456789"


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _form(boundary: str, *parts: tuple[str, bytes]) -> bytes:
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{n}"\r\n\r\n'
                    .encode() + v + b"\r\n" for n, v in parts)
    return body + f"--{boundary}--\r\n".encode()


def _upload(base: str, key: str, content_type: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base}/v1/audio/transcriptions", content=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}",
                               "Content-Type": content_type})


def _last(sim: str) -> dict[str, Any]:
    sent: dict[str, Any] = httpx.get(f"{sim}/sim/requests", params={"n": 1}).json()[
        "requests"][0]
    return sent


def test_a_parameter_ending_in_boundary_is_not_the_boundary(
        gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    body = _form("Q", ("model", b"open"), ("file", b"RIFF"))
    got = _upload(base, keys["default"], "multipart/form-data; xboundary=Z; boundary=Q", body)
    assert got.status_code == 200, got.text
    assert _last(keys["sim"])["body"]["model"] == "sim-model"


def test_boundaries_of_70_and_71_characters(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    for size, status in ((70, 200), (71, 400)):
        mark = "b" * size
        got = _upload(base, keys["default"], f"multipart/form-data; boundary={mark}",
                      _form(mark, ("model", b"open"), ("file", b"RIFF")))
        assert got.status_code == status, got.text
    error = got.json()["error"]
    assert "1 to 70 characters" in error["message"] and "71" in error["message"]
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_a_model_field_not_utf8_is_named(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    got = _upload(base, keys["default"], "multipart/form-data; boundary=Q",
                  _form("Q", ("model", b"\xff\xfeopen"), ("file", b"RIFF")))
    assert got.status_code == 400
    error = got.json()["error"]
    assert error["param"] == "model" and "UTF-8" in error["message"]


def test_a_cache_salt_part_behind_a_quoted_filename_is_dropped(
        gw: tuple[str, dict[str, str]]) -> None:
    """A filename holding ``;name=file`` is the filename's text: the part is `cache_salt`
    (as vLLM's form parser reads it) and is never sent on."""
    base, keys = gw
    hidden = (b'--Q\r\nContent-Disposition: form-data; filename="x;name=file"; '
              b'name="cache_salt"\r\n\r\nnot-mine\r\n')
    got = _upload(base, keys["default"], "multipart/form-data; boundary=Q",
                  hidden + _form("Q", ("model", b"open"), ("file", b"RIFF")))
    assert got.status_code == 200, got.text
    sent = _last(keys["sim"])["body"]
    assert "cache_salt" not in sent and sent["file"] == "4"


@pytest.mark.parametrize(("top_n", "status", "results"), [
    ("x", 400, 0), (1.5, 400, 0), ("1", 200, 1), (-1, 200, 3), (None, 200, 3)])
def test_a_rerank_top_n_the_replica_cannot_read_is_its_400(
        gw: tuple[str, dict[str, str]], top_n: object, status: int, results: int) -> None:
    base, keys = gw
    body: dict[str, Any] = {"model": "open", "query": "q", "documents": ["a", "b", "c"]}
    if top_n is not None:
        body["top_n"] = top_n
    got = httpx.post(f"{base}/v1/rerank", json=body, timeout=30,
                     headers={"Authorization": f"Bearer {keys['default']}"})
    assert got.status_code == status, got.text
    if status == 400:
        assert got.json()["error"]["param"] == "top_n"
    else:
        assert len(got.json()["results"]) == results
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_authorization_wins_over_x_api_key_on_messages(gw: tuple[str, dict[str, str]]) -> None:
    """The documented choice: ``Authorization`` names the tenant, whatever ``x-api-key``
    holds (a premium-only model is served with the premium bearer beside a default key, and
    refused with the default bearer beside a premium key)."""
    base, keys = gw
    for bearer, other, served in ((keys["premium"], keys["default"], True),
                                  (keys["default"], keys["premium"], False)):
        client = anthropic.Anthropic(base_url=base, api_key=other, max_retries=0,
                                     default_headers={"Authorization": f"Bearer {bearer}"})
        ask = {"model": "gold-only", "max_tokens": 3,
               "messages": [{"role": "user", "content": "hi"}]}
        if served:
            assert client.messages.create(**ask).content  # type: ignore[call-overload]
        else:
            with pytest.raises(anthropic.NotFoundError):
                client.messages.create(**ask)  # type: ignore[call-overload]


def _prompt_tokens(base: str) -> float:
    counted = metric_values(base, "kvgate_tenant_tokens_total")
    return sum(v for labels, v in counted.items()
               if 'kind="prompt"' in labels and 'tenant="basic"' in labels)


def test_a_large_rerank_counts_the_replicas_total(gw: tuple[str, dict[str, str]]) -> None:
    """vLLM's rerank usage has only ``total_tokens``: it is the prompt tokens counted (and
    charged), not nothing."""
    base, keys = gw
    before = _prompt_tokens(base)
    docs = [f"document {n} about replica scheduling" for n in range(2000)]
    got = httpx.post(f"{base}/v1/rerank", timeout=60,
                     headers={"Authorization": f"Bearer {keys['default']}"},
                     json={"model": "open", "query": "which replica", "documents": docs,
                           "top_n": 2})
    assert got.status_code == 200, got.text
    total = got.json()["usage"]["total_tokens"]
    assert total > 10_000 and len(got.json()["results"]) == 2
    wait_for(lambda: _prompt_tokens(base) - before == total, what="the rerank's tokens")
