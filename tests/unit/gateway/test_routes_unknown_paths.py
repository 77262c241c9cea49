"""The 404s around the vLLM routes kvgate serves (`gateway.app.unknown_path`)."""

from __future__ import annotations

import pytest

from gateway.app import SERVED, unknown_path


@pytest.mark.parametrize("path", ["/v1/tokenize", "/v1/detokenize", "/v1/pooling",
                                  "/v1/classify"])
def test_a_root_route_asked_under_v1_names_it(path: str) -> None:
    assert unknown_path(path).message == (
        f"Unknown path {path}. Did you mean {path[3:]}? (vLLM serves it outside /v1: use the "
        "base URL without /v1 for it)")


def test_anthropic_paths_without_v1_are_hinted_and_others_named() -> None:
    assert unknown_path("/messages").message == ("Unknown path /messages. Did you mean "
                                                 "/v1/messages? (the base URL ends in /v1)")
    assert unknown_path("/v2/embed").message == (
        f"/v2/embed is a vLLM endpoint that kvgate does not serve (it serves {SERVED}).")
    assert SERVED == ("/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses "
                      "and /v1/models")
