"""`kvgate admin` given the admin token on its command line, as `kvgate doctor --admin-token`
takes it: refused by name, and the token is not printed back (argparse read `--token` as a
prefix of --token-env and answered "$<the token> is not set"; `--admin-token` was an
unrecognized argument, echoed with its value)."""

from __future__ import annotations

import pytest

from gateway.cli.admin import main

TOKEN = "s3cr3t-0123456789abcdef-token"


@pytest.mark.parametrize("argv", [
    ["--token", TOKEN],
    [f"--token={TOKEN}"],
    ["--admin-token", TOKEN],
    ["--token-env", TOKEN],
    ["--token-env", "0123456789abcdef0123"],  # a hex token, as `openssl rand -hex` makes
])
def test_a_token_on_the_command_line_is_refused_without_echoing_it(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "admintoken-0123456789abcdef")
    code = main([*argv, "--url", "http://127.0.0.1:9", "tenants", "list"])
    err = capsys.readouterr().err
    assert code == 2
    assert argv[-1].split("=")[-1] not in err
    assert "environment variable" in err or "from the environment" in err, err


def test_a_variable_name_is_still_taken(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MY_ADMIN_TOKEN", raising=False)
    code = main(["--token-env", "MY_ADMIN_TOKEN", "--url", "http://127.0.0.1:9", "tenants",
                 "list"])
    assert code == 2
    assert "$MY_ADMIN_TOKEN is not set" in capsys.readouterr().err
