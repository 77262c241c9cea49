"""`parse_bearer` reads the credentials after a space or a tab (HTTP's whitespace in a field
value): ``Bearer<TAB><key>`` read as no key, a 401 "missing API key" for a key the client sent."""

from __future__ import annotations

import pytest

from gateway.tenancy.resolver import parse_bearer


@pytest.mark.parametrize("value", ["Bearer k1", "Bearer\tk1", "bearer \t k1 ", "BEARER\t\tk1"])
def test_the_key_after_the_scheme(value: str) -> None:
    assert parse_bearer(value) == "k1"


@pytest.mark.parametrize("value", [None, "", "Bearer", "Bearer\t", "Bearer \t ", "Basic\tk1",
                                   "Bearerk1", "\tBearer k1x"])
def test_no_bearer_key(value: str | None) -> None:
    assert parse_bearer(value) is None


def test_a_tab_inside_the_token_is_kept() -> None:
    assert parse_bearer("Bearer a\tb") == "a\tb"
