"""`kvgate serve --help` as a new user reads it: the policies it takes, the levels, and a
replica URL as the config wants it (the server's address: a URL ending in /v1 is refused)."""

from __future__ import annotations

from gateway.cli.serve import build_parser
from gateway.config import LOG_LEVELS
from routing.policies import REGISTRY


def _help() -> str:
    return " ".join(build_parser().format_help().split())  # argparse's wrapping undone


def test_serve_help_names_every_policy_and_level() -> None:
    text = _help()
    assert all(name in text for name in REGISTRY), text
    assert all(level in text for level in LOG_LEVELS), text


def test_serve_help_does_not_call_a_replica_url_a_base_url() -> None:
    """"a vLLM replica base URL" reads as the OpenAI base URL, `http://host:8000/v1`, which
    `--upstream` refuses."""
    text = _help()
    assert "base URL" not in text
    assert "without /v1" in text
