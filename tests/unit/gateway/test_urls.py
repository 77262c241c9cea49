"""`shown_url`: a URL's userinfo is hidden, nothing else changes."""

from __future__ import annotations

import pytest

from gateway.urls import shown_url


@pytest.mark.parametrize(("url", "shown"), [
    ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
    ("http://user:pw@10.0.0.1:8000", "http://***@10.0.0.1:8000"),
    ("https://token@vllm.example/", "https://***@vllm.example/"),
    ("http://user:p@ss@h:1/x?y=1", "http://***@h:1/x?y=1"),  # an @ in the password
    ("http://u:pw@[::1]:8000", "http://***@[::1]:8000"),
    ("http://h:1/path@x", "http://h:1/path@x"),  # an @ past the host is not userinfo
    ("http://u:pw@[::1:8000", "http://***@[::1:8000"),  # not a valid URL: hidden anyway
    ("u:pw@h", "***@h"),
])
def test_shown_url(url: str, shown: str) -> None:
    assert shown_url(url) == shown
