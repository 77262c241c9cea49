"""vLLM's ``GET /tokenizer_info`` through kvgate: asked of a replica of the pool serving the
key's model (``?model=`` or the key's only one), the key checked, an unknown model the 404
listing the key's, a key with several models and none asked the 400 naming them, another
method the 405. It was a 404 saying kvgate does not serve it. A real gateway (authentication
on, two tiers) before one simulated replica, httpx over 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway import two_tier_gateway

ADMIN = "routes2-tokenizer-admin-0123456789"


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[str, dict[str, str]]]:
    with two_tier_gateway("gold-only", ADMIN) as made:
        yield made


def _get(base: str, key: str, **params: str) -> httpx.Response:
    return httpx.get(f"{base}/tokenizer_info", params=params, timeout=30,
                     headers={"Authorization": f"Bearer {key}"})


def test_the_keys_only_model_or_the_asked_one(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    for answer in (_get(base, keys["default"]), _get(base, keys["premium"], model="gold-only")):
        assert answer.status_code == 200, answer.text
        assert answer.json()["name_or_path"] == "sim-model"  # the replica's own answer
        assert answer.json()["tokenizer_class"] == "SimTokenizer"
        assert answer.headers["x-kvgate-replica"].startswith("p/")
        assert answer.headers["x-request-id"]


def test_refusals(gw: tuple[str, dict[str, str]]) -> None:
    base, keys = gw
    assert _get(base, "sk-not-a-key").status_code == 401
    several = _get(base, keys["premium"])
    assert several.status_code == 400 and several.json()["error"]["param"] == "model"
    assert "gold-only" in several.json()["error"]["message"]
    unknown = _get(base, keys["default"], model="gold-only")  # the premium tier's only
    assert unknown.status_code == 404 and "open" in unknown.json()["error"]["message"]
    posted = httpx.post(f"{base}/tokenizer_info", json={},
                        headers={"Authorization": f"Bearer {keys['default']}"})
    assert posted.status_code == 405 and posted.headers["allow"] == "GET, HEAD"
