"""`shown_url`: a URL's userinfo is hidden, nothing else changes."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.urls import restore_hidden, shown_policy, shown_url


@pytest.mark.parametrize(("url", "shown"), [
    ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
    ("http://user:pw@10.0.0.1:8000", "http://***@10.0.0.1:8000"),
    ("https://token@vllm.example/", "https://***@vllm.example/"),
    ("http://user:p@ss@h:1/x?y=1", "http://***@h:1/x?y=1"),  # an @ in the password
    ("http://u:pw@[::1]:8000", "http://***@[::1]:8000"),
    ("http://h:1/path@x", "http://h:1/path@x"),  # an @ past the host is not userinfo
    ("http://u:pw@[::1:8000", "http://***@[::1:8000"),  # not a valid URL: hidden anyway
    ("u:pw@h", "***@h"),
    ("http://u:p#w@h:1/x", "http://***@h:1/x"),  # a raw # or ? in the password: hidden too
    ("http://u:p?w@h:1", "http://***@h:1"),
])
def test_shown_url(url: str, shown: str) -> None:
    assert shown_url(url) == shown


def test_a_policy_is_shown_without_credentials_and_they_come_back() -> None:
    stored = {"pools": {"a": {"served_model": "m", "replicas": [
        "http://u:pw@10.0.0.1:8000", "http://10.0.0.2:8000"]}}, "models": {}}
    shown = shown_policy(stored)
    assert shown["pools"]["a"]["replicas"] == ["http://***@10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert stored["pools"]["a"]["replicas"][0] == "http://u:pw@10.0.0.1:8000"  # not changed
    sent = {"pools": {"b": {"served_model": "m", "replicas": ["http://***@10.0.0.1:8000"]}}}
    assert restore_hidden(sent, stored) is None
    assert sent["pools"]["b"]["replicas"] == ["http://u:pw@10.0.0.1:8000"]  # moved pools too
    unknown = {"pools": {"a": {"replicas": ["http://***@10.0.0.9:8000"]}}}
    assert restore_hidden(unknown, stored) == "http://***@10.0.0.9:8000"
    assert restore_hidden(unknown, None) == "http://***@10.0.0.9:8000"
    odds: list[Any] = [{}, {"pools": []}, {"pools": {"a": None}}, {"pools": {"a": {"replicas": 1}}},
                       []]
    for odd in odds:
        assert restore_hidden(odd, stored) is None  # validation answers these
        if isinstance(odd, dict):
            assert shown_policy(odd) == odd
