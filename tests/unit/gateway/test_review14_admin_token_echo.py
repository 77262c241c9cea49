"""`kvgate admin` given its admin token where a variable's name or a flag goes, in the shapes
test_cli2_admin_token_flag.py does not try: a hex token whose first digit is a letter (a
valid variable name: answered "$<the token> is not set"), and an abbreviated flag with the
token after ``=`` that matches two flags (argparse's "ambiguous option: --tok=<the token>").
Refused, exit 2, the token never printed."""

from __future__ import annotations

import pytest

from gateway.cli.admin import main

HEX = "abcdef0123456789abcdef0123456789"  # `openssl rand -hex 16` may well start so


@pytest.mark.parametrize("argv", [
    ["--token-env", HEX],
    ["--token-e", HEX],
    [f"--tok={HEX}"],
    [f"--to={HEX}"],
])
def test_the_token_is_not_printed_back(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(HEX, raising=False)
    code = main([*argv, "--url", "http://127.0.0.1:9", "tenants", "list"])
    err = capsys.readouterr().err
    assert code == 2
    assert HEX not in err, err
    assert "kvgate admin" in err


def test_a_conventional_variable_name_is_still_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OPS_ADMIN_TOKEN", raising=False)
    assert main(["--token-env", "OPS_ADMIN_TOKEN", "--url", "http://127.0.0.1:9", "tenants",
                 "list"]) == 2
    assert "$OPS_ADMIN_TOKEN is not set" in capsys.readouterr().err
