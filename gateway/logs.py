"""Logging set-up: one JSON object per line (default for `kvgate serve`) or readable text.

Structured fields travel in ``extra={...}`` and come out as top-level JSON keys (or
``key=value`` pairs in text). Callers pass only what may be logged: ids, names, counts and
timings, never prompts, API keys, salts or headers (the request line in `proxy.py` is built
from an explicit list of fields for that reason). The HTTP client libraries log at WARNING
only: their DEBUG/INFO lines would repeat every upstream request, URLs and headers included.
So does redis-py: at `--log-level debug` it said "Failed to enable maintenance notifications"
for every connection it opened to a Redis without them (nothing kvgate uses had failed);
kvgate's own lines say what Redis does (`gateway.tenancy.reachability`).

A worker of ``server.workers`` > 1 names itself on every line (``"worker": 1``, or
``worker=1`` in text): the workers share one stderr, and an operator could not tell which
process had logged a line (an ejection, a Redis error, a request).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal, Protocol

import orjson

from gateway.errors import shown_name
from gateway.tenancy.keys import hide_keys
from gateway.worker_metrics import current

__all__ = ["JsonFormatter", "LogFormat", "TextFormatter", "configure_logging", "log_request"]

LogFormat = Literal["json", "text"]
QUIET_LOGGERS = ("httpx", "httpcore", "aiohttp", "asyncio", "redis")
# attributes every LogRecord has; anything else on a record came from `extra`
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName",
    "color_message",  # uvicorn's copy of its message with ANSI colour escapes
}


# Characters that end a line for some reader (Python's `str.splitlines` counts \x1c-\x1e,
# \x85, \u2028 and \u2029 too) or steer a terminal: escaped wherever a value a client chose
# (a model name, say) may reach a log line, so it can never start a forged line of its own.
_TEXT_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"}
# orjson escapes C0 controls itself; these it writes as they are, inside JSON strings
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in (*range(0x7F, 0xA0), 0x2028, 0x2029)}


def _one_line(text: str) -> str:
    """`text` with its control and line-breaking characters escaped (``\\n``, ``\\x1b``)."""
    return text if text.isprintable() else text.translate(_TEXT_ESCAPES)


def _text_value(value: object) -> str:
    """A field's value in a text line: quoted (JSON's escapes) when it holds a space, ``=`` or
    a quote, else as it is -- a model name or request id a client chose such as
    ``x tenant=other status=200`` otherwise read as fields of their own."""
    text = str(value)
    if text and not any(c in text for c in ' ="\\') and text.isprintable():
        return text
    return _one_line(json.dumps(text, ensure_ascii=False))


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    """The record's own fields, after ``worker`` (this process's slot) in a worker process."""
    slot = current()
    own = {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
    return own if slot is None else {"worker": slot.slot, **own}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", **extra, "exc"?}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_extras(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        line = orjson.dumps(doc, default=str).decode()
        return line if line.isprintable() else line.translate(_JSON_ESCAPES)


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...`` for people reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The line before its fields; a traceback, if any, follows on lines of its own."""
        line = _one_line(super().formatMessage(record))
        fields = " ".join(f"{k}={_text_value(v)}" for k, v in _extras(record).items())
        return f"{line} {fields}" if fields else line


def configure_logging(level: str, fmt: LogFormat = "text") -> None:
    """Configure the root logger once, at start-up (replaces any handler already there)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class _Parsed(Protocol):
    model: str
    stream: bool


class RequestRecord(Protocol):
    """What the request line reads from the proxy's per-request state."""

    req_id: bytes
    up_id: bytes  # the X-Request-Id its replica is sent (`gateway.request.replica_id`)
    tenant_id: str
    tier: str
    kind: str
    pool_name: str
    replica: str
    route: str
    attempts: int
    status: int
    ttft: float | None
    usage: dict[str, int] | None
    queued_s: float | None


def log_request(logger: logging.Logger, req: RequestRecord, total_s: float) -> None:
    """A request's one INFO line: ids, routing, status, tokens, timings. Built from this
    explicit list, so nothing else (prompt, key, salt, headers) can end up in it.
    ``upstream_request_id`` is the X-Request-Id its replica is sent (the client's id with a
    kvgate id appended, when the client chose one): vLLM's own logs name the request by it."""
    usage = req.usage or {}
    parsed: _Parsed | None = getattr(req, "parsed", None)  # unset when the body was refused
    logger.info("request", extra={
        "request_id": req.req_id.decode("latin-1"),
        "upstream_request_id": req.up_id.decode("latin-1"), "tenant": req.tenant_id,
        "tier": req.tier,
        "model": hide_keys(shown_name(parsed.model)) if parsed is not None else None,
        "kind": req.kind,
        "stream": parsed.stream if parsed is not None else None, "pool": req.pool_name,
        "replica": req.replica, "route": req.route, "attempts": req.attempts,
        "status": req.status, "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": usage.get("cached_tokens"),
        "ttft_ms": round(req.ttft * 1000, 1) if req.ttft is not None else None,
        "total_ms": round(total_s * 1000, 1),
        "queued_ms": round(req.queued_s * 1000, 1) if req.queued_s is not None else None,
    })
