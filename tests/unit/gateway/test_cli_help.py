"""`kvgate serve --help` and `kvgate admin ... --help` as a new user reads them: the policies
and levels serve takes, a replica URL as the config wants it (the server's address: a URL
ending in /v1 is refused), and a word for every argument of the admin client."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.cli.admin import _parser as admin_parser
from gateway.cli.serve import build_parser
from gateway.config import LOG_LEVELS
from gateway.epp.cli import build_parser as epp_parser
from loadtest.sim.cli import parser as sim_parser
from routing.policies import REGISTRY


def _help() -> str:
    return " ".join(build_parser().format_help().split())  # argparse's wrapping undone


def test_serve_help_names_every_policy_and_level() -> None:
    text = _help()
    assert all(name in text for name in REGISTRY), text
    assert all(level in text for level in LOG_LEVELS), text


@pytest.mark.parametrize("build", [build_parser, epp_parser])
def test_serve_help_does_not_call_a_replica_url_a_base_url(
    build: Callable[[], argparse.ArgumentParser],
) -> None:
    """"a vLLM replica base URL" reads as the OpenAI base URL, `http://host:8000/v1`, which
    `--upstream` refuses (`kvgate serve` and `kvgate epp` alike)."""
    text = " ".join(build().format_help().split())
    assert "base URL" not in text
    assert "without /v1" in text


def test_every_sim_argument_says_what_it_takes() -> None:
    assert [a.dest for _, a in _commands(sim_parser(), "kvgate sim") if not a.help] == []


def _commands(p: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.Action]]:
    """Every argument of `p` and of its sub-commands, with the command it belongs to."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, parser in action.choices.items():
                yield from _commands(parser, f"{name} {sub}")
        elif not isinstance(action, argparse._HelpAction):
            yield name, action


def test_every_admin_argument_says_what_it_takes() -> None:
    """`kvgate admin rotate-salt --help` showed a bare `tenant`, `audit --limit LIMIT` no
    bound, `keys revoke` no word of where a key id comes from."""
    bare = [f"{name} {action.dest}" for name, action in _commands(admin_parser(), "kvgate admin")
            if not action.help]
    assert bare == []


def test_none_means_what_the_command_does_with_it() -> None:
    """On `tenants create`, "none: the tier's limit again" read as if there were a limit
    before."""
    helps = {name: action.help for name, action in _commands(admin_parser(), "kvgate admin")
             if action.dest == "rpm"}
    assert "again" not in (helps["kvgate admin tenants create"] or "")
    assert "again" in (helps["kvgate admin tenants update"] or "")


def test_every_serve_flag_is_in_the_readme_and_the_config_reference() -> None:
    """README's flag table and docs/configuration.md's list of flags name every flag of
    `kvgate serve`, and no flag it lacks."""
    root = Path(__file__).resolve().parents[3]
    flags = {o for a in build_parser()._actions for o in a.option_strings
             if o.startswith("--") and o != "--help"}
    assert {"--config", "--upstream", "--port", "--no-auth"} <= flags
    for page in ("README.md", "docs/configuration.md"):
        text = (root / page).read_text()
        named = set(re.findall(r"`(--[a-z-]+)", text))
        assert sorted(flags - named) == [], f"{page} leaves out these serve flags"
    readme_table = (root / "README.md").read_text().split("| flag or variable |")[1]
    in_table = set(re.findall(r"`(--[a-z-]+)", readme_table.split("\n\n")[0]))
    assert sorted(in_table - flags) == [], "README's table names flags serve lacks"
