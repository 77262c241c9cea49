"""A doubled `/v1` (`/v1/v1/chat/completions`: a base URL ending in /v1 given to a client that
adds /v1 itself) gets a 404 that says /v1 came twice; it said "without the /v1 prefix", read
as "drop /v1" from a path that needs it."""

from __future__ import annotations

import pytest

from gateway.paths import prefixed_route


@pytest.mark.parametrize("path", ["/v1/v1/chat/completions", "/v1/v1/models",
                                  "/v1/v1/embeddings"])
def test_a_doubled_v1_says_it_came_twice(path: str) -> None:
    found = prefixed_route(path)
    assert found is not None
    assert "/v1 appears twice" in found.message
    assert "without the" not in found.message


def test_another_prefix_is_named_as_before() -> None:
    found = prefixed_route("/openai/v1/chat/completions")
    assert found is not None
    assert "without the /openai prefix" in found.message
