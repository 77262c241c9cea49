"""A field that takes one of a few words (`server.log_format`, `tenancy.client_salt`,
`tenancy.salt_encoding`) given another: the error said which words it takes but not what
the file held, where every other wrong value says `(got ...)` -- `log_format: JSON` read
"Input should be 'json' or 'text'" beside a file that seemed to say just that."""

from __future__ import annotations

import pytest

from gateway.config import load_config
from gateway.errors import ConfigError

POOLS = {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}


@pytest.mark.parametrize(("section", "field", "value", "line"), [
    ("server", "log_format", "JSON", "server.log_format: Input should be 'json' or 'text' "
                                     "(got 'JSON')"),
    ("tenancy", "client_salt", "drop", "tenancy.client_salt: Input should be 'strip' or "
                                       "'reject' (got 'drop')"),
    ("tenancy", "salt_encoding", 64, "tenancy.salt_encoding: Input should be 'hex' or "
                                     "'base64url' (got 64)"),
])
def test_a_word_not_taken_says_what_the_file_held(
        section: str, field: str, value: object, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={}, overrides={**POOLS, section: {field: value}})
    assert info.value.message.splitlines()[1].strip() == line


def test_from_a_variable_it_names_the_variable_too() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides=POOLS, environ={"KVGATE_SERVER__LOG_FORMAT": "yaml"})
    assert info.value.message.splitlines()[1].strip() == (
        "server.log_format: Input should be 'json' or 'text' (got 'yaml') "
        "(from KVGATE_SERVER__LOG_FORMAT)")
