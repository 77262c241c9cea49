"""`kvgate help help` (and `kvgate help --help`) print the usage, as `kvgate help` does: they
said "unknown command 'help'" (and '-h'), exit 2, though `help` is what the usage tells a user
to type."""

from __future__ import annotations

import pytest

from gateway.cli import main


@pytest.mark.parametrize("second", ["help", "--help", "-h"])
def test_help_about_help_prints_the_usage(capsys: pytest.CaptureFixture[str],
                                          second: str) -> None:
    assert main(["help", second]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("usage: kvgate COMMAND [options]") and out.err == ""


def test_help_about_a_command_still_shows_its_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["help", "config"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out
