"""`kvgate doctor`: ask a running gateway for its diagnosis.

    kvgate doctor --url URL [--admin-token TOKEN] [--window 5m] [--json] [--cache]

Reads ``GET /admin/doctor?window=...`` (admin token from ``--admin-token`` or
``$KVGATE_ADMIN_TOKEN``) and prints the findings as a table, worst first (``--cache``: the
cache return per tenant and pool instead; ``--json``: the whole report as JSON). Every error
is one line on stderr: exit status 2 for usage (bad flags, no token, a bad window), 1 when
the gateway cannot be reached or refuses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, NoReturn

import httpx

from gateway.cli.admin_http import NOT_ADMIN_PORT, TOKEN_HELP, client_token, not_admin_port
from gateway.doctor.render import parse_duration, render_cache, render_findings

__all__ = ["main"]

PROG = "kvgate doctor"
REPORT_KEYS = ("window", "history", "worst", "findings", "cache")  # what the renderers read


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise _Usage(f"{message} (see `{PROG} --help`)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Diagnose a running kvgate gateway and its replicas: "
                "findings per pool and replica (class, severity, evidence, one action).")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the gateway (or its admin port): default %(default)s")
    p.add_argument("--admin-token",
                   help=f"admin token (default: $KVGATE_ADMIN_TOKEN; {TOKEN_HELP})")
    p.add_argument("--window", default="5m",
                   help="how far back to look: 30s, 5m, 1h (default %(default)s; at most the "
                        "gateway's doctor.history_s)")
    p.add_argument("--json", action="store_true", help="the whole report as JSON")
    p.add_argument("--cache", action="store_true",
                   help="the cache return per tenant and pool instead of the findings")
    p.add_argument("--timeout", type=float, default=15.0,
                   help="seconds for the whole answer (default %(default)s)")
    return p


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _read(url: str, token: str, window: str, timeout: float) -> tuple[httpx.Response, bytes]:
    """The answer, read within ``timeout`` seconds in all (httpx's timeouts are per read, so
    a link trickling a byte a second would otherwise never time out)."""
    deadline = time.monotonic() + timeout
    body = bytearray()
    with httpx.stream("GET", f"{url}/admin/doctor", params={"window": window},
                      headers={"authorization": f"Bearer {token}"}, timeout=timeout) as response:
        for chunk in response.iter_bytes():
            body += chunk
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout("the whole answer took too long")
    return response, bytes(body)


def _fetch(url: str, token: str, window: str, timeout: float) -> dict[str, Any]:
    response, body = _read(url, token, window, timeout)
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if response.is_error:
        message = None
        if isinstance(payload, dict):
            message = (payload.get("error") or {}).get("message")
        hint = " (a kvgate gateway with `kvgate doctor` support?)" \
            if response.status_code == 404 else ""
        if not_admin_port(response.status_code, message):
            hint = f": {NOT_ADMIN_PORT}"
        raise RuntimeError(f"{url}: HTTP {response.status_code}: "
                           f"{message or response.reason_phrase}{hint}")
    if not isinstance(payload, dict) or payload.get("object") != "doctor":
        raise RuntimeError(f"{url} did not answer with a doctor report (is it a kvgate gateway?)")
    missing = [k for k in REPORT_KEYS if not isinstance(payload.get(k), dict | list | str)]
    if missing:
        raise RuntimeError(f"{url} answered an incomplete doctor report (no {', '.join(missing)}"
                           "): a different kvgate version?")
    return payload


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
        parse_duration(args.window)
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise _Usage("--timeout must be positive and finite (seconds)")
    except _Usage as exc:
        return _fail(str(exc), 2)
    except ValueError as exc:
        return _fail(f"--window: {exc}", 2)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    try:
        token = args.admin_token or client_token(os.environ.get("KVGATE_ADMIN_TOKEN", ""))
    except ValueError as exc:
        return _fail(str(exc), 2)
    if not token:
        return _fail("no admin token: pass --admin-token or set KVGATE_ADMIN_TOKEN", 2)
    url = args.url.rstrip("/")
    try:
        host = httpx.URL(url).host if url.startswith(("http://", "https://")) else ""
    except httpx.InvalidURL:
        host = ""
    if not host:
        return _fail(f"--url {args.url!r}: expected http://HOST:PORT", 2)
    try:
        report = _fetch(url, token, args.window, args.timeout)
    except httpx.TimeoutException:
        return _fail(f"{url} did not answer within {args.timeout:g} s", 1)
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        return _fail(f"cannot reach {url}: {reason}", 1)
    except RuntimeError as exc:
        return _fail(str(exc), 1)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    elif args.cache:
        print(render_cache(report, url))
    else:
        print(render_findings(report, url))
    return 0
