"""404s that name what to change: a doubled `/v1` (`/v1/v1/chat/completions`: a base URL
ending in /v1 given to a client that adds /v1 itself) says /v1 came twice (it said "without
the /v1 prefix", read as "drop /v1"); an AzureOpenAI client's deployment path names the route and
the model to use."""

from __future__ import annotations

import pytest

from gateway.app import unknown_path
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


@pytest.mark.parametrize(("path", "route"), [
    ("/openai/deployments/gpt-4o/chat/completions", "/v1/chat/completions"),
    ("/openai/deployments/emb/embeddings", "/v1/embeddings"),
    ("/openai/deployments/gpt-4o/completions", "/v1/completions"),
])
def test_an_azure_deployment_path_names_the_route_and_the_model(path: str, route: str) -> None:
    """It said to use a base URL ending in /v1, naming neither the route nor the model."""
    found = unknown_path(path)
    name = path.split("/")[3]
    assert f"({route}, with model `{name}`)" in found.message
    assert "not Azure OpenAI's deployments" in found.message


@pytest.mark.parametrize("path", ["/openai/deployments/x/images/generations",
                                  "/openai/deployments/", "/openai/deployments/x"])
def test_another_deployment_path_is_still_named_azure(path: str) -> None:
    found = unknown_path(path)
    assert "not Azure OpenAI's deployments" in found.message
    assert "with model" not in found.message
