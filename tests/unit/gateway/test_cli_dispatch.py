"""The `kvgate` dispatcher and its commands on a new user's first guesses: a misspelt
command named the command meant for no one (`kvgate confg` said "unknown command" and no
more, where a misspelt flag says `did you mean --port?`), `kvgate help` and `kvgate help serve`
were unknown commands, `kvgate` alone, a usage error (exit 2), printed its usage on standard
output, and `kvgate epp` and `kvgate envoy` named no flag meant for a misspelt one."""

from __future__ import annotations

import pytest

from gateway.cli import main


@pytest.mark.parametrize(("typed", "meant"), [("confg", "config"), ("sreve", "serve"),
                                              ("doctr", "doctor")])
def test_a_misspelt_command_names_the_command_meant(
        capsys: pytest.CaptureFixture[str], typed: str, meant: str) -> None:
    assert main([typed]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"kvgate: unknown command {typed!r} (did you mean {meant}?)"


def test_an_unknown_command_with_nothing_close_suggests_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["xyzzy"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == "kvgate: unknown command 'xyzzy'"


def test_help_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvgate COMMAND") and "kvgate help COMMAND" in out


def test_help_command_is_the_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:  # argparse's --help exits 0
        main(["help", "config"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvgate config")


def test_no_command_is_a_usage_error_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("usage: kvgate COMMAND")


@pytest.mark.parametrize(("argv", "meant"), [
    (["envoy", "--upstream", "http://127.0.0.1:1", "--listen-prot", "8081"], "--listen-port"),
    (["epp", "--upstream", "http://127.0.0.1:1", "--http-prot", "9090"], "--http-port"),
    (["serve", "--prot", "9000"], "--port"),
])
def test_a_misspelt_flag_names_the_flag_meant_in_every_gateway_command(
        capsys: pytest.CaptureFixture[str], argv: list[str], meant: str) -> None:
    """`kvgate serve` said `did you mean --port?`; `kvgate epp` and `kvgate envoy` (whose
    docs say the same) only "unrecognized arguments"."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"(did you mean {meant}?)")
