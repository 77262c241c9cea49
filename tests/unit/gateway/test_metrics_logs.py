"""Log formatting: JSON lines carry `extra` fields at the top level; the request line is
built from its explicit field list only."""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace

import pytest

from gateway.logs import JsonFormatter, TextFormatter, configure_logging, log_request


def record(msg: str = "hello", **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("kvgate.test", logging.INFO, __file__, 1, msg, (), None)
    rec.__dict__.update(extra)
    return rec


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, {}),
        ({"pool": "fp8", "replicas": 2}, {"pool": "fp8", "replicas": 2}),
        ({"ids": ["a:1"], "ok": None}, {"ids": ["a:1"], "ok": None}),
    ],
)
def test_json_line_has_extras_at_top_level(extra: dict[str, object],
                                           expected: dict[str, object]) -> None:
    doc = json.loads(JsonFormatter().format(record("hello", **extra)))
    assert doc.pop("ts").endswith("Z")
    assert doc == {"level": "info", "logger": "kvgate.test", "msg": "hello", **expected}


def test_text_line_appends_fields() -> None:
    line = TextFormatter().format(record(pool="fp8"))
    assert line.endswith("INFO kvgate.test hello pool=fp8")


def test_exceptions_are_one_json_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(rec)
    assert "\n" not in line and "ValueError: boom" in json.loads(line)["exc"]


def test_request_line_reads_only_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    req = SimpleNamespace(
        req_id=b"r-1", up_id=b"r-1-00ab", tenant_id="acme", tier="premium", kind="chat",
        pool_name="fp8",
        replica="10.0.0.1:8000", route="prefix-hit", attempts=1, status=200, ttft=0.0123,
        usage={"prompt_tokens": 10, "completion_tokens": 3}, queued_s=0.25,
        parsed=SimpleNamespace(model="llama", stream=True, data={"messages": "secret prompt"}),
        extra=[(b"authorization", b"Bearer sk-secret")],
    )
    logger = logging.getLogger("kvgate.test.request")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_request(logger, req, 0.5)
    line = JsonFormatter().format(caplog.records[0])
    doc = json.loads(line)
    assert doc["request_id"] == "r-1" and doc["tenant"] == "acme" and doc["model"] == "llama"
    assert doc["upstream_request_id"] == "r-1-00ab"  # what the replica's logs call it
    assert doc["ttft_ms"] == 12.3 and doc["total_ms"] == 500.0 and doc["cached_tokens"] is None
    assert doc["queued_ms"] == 250.0
    assert "secret" not in line and "Bearer" not in line


def test_configure_logging_quiets_http_clients() -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("debug", "json")
        assert isinstance(root.handlers[-1].formatter, JsonFormatter)
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
