"""A text log line's fields are read back as they were logged, whatever a client chose for
the values it names (a model, a request id)."""

from __future__ import annotations

import logging
import shlex

import pytest

from gateway.logs import TextFormatter


def fields(**extra: object) -> list[tuple[str, str]]:
    """The ``key=value`` fields of the text line logged with `extra`, read as a shell reads
    words (quotes group, backslashes escape)."""
    rec = logging.LogRecord("kvgate.test", logging.INFO, __file__, 1, "request", (), None)
    rec.__dict__.update(extra)
    line = TextFormatter().format(rec)
    words = shlex.split(line.split(" request ", 1)[1])
    return [(key, value) for key, _, value in (word.partition("=") for word in words)]


@pytest.mark.parametrize("chosen", [
    "x tenant=other status=200", 'a" tenant="b', "a\\\" tenant=b", "", "tab\there", "=",
])
def test_edge_a_clients_value_cannot_forge_text_log_fields(chosen: str) -> None:
    """A value with spaces, `=` or quotes is quoted: it reads back as one field, the one it
    was (a model name ``x tenant=other`` wrote a second `tenant` field into the line)."""
    got = fields(model=chosen, tenant="acme", status=404)
    assert [key for key, _ in got] == ["model", "tenant", "status"]
    assert got[1:] == [("tenant", "acme"), ("status", "404")]
    if chosen.isprintable():
        assert got[0] == ("model", chosen)


def test_edge_plain_values_stay_unquoted() -> None:
    line = TextFormatter().format(logging.LogRecord(
        "kvgate.test", logging.INFO, __file__, 1, "request", (), None))
    assert line.endswith("INFO kvgate.test request")
    assert fields(model="llama-3.1", pool="p", attempts=2) == [
        ("model", "llama-3.1"), ("pool", "p"), ("attempts", "2")]
