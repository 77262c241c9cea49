"""`kvgate doctor`: ask a running gateway for its diagnosis.

    kvgate doctor --url URL [--admin-token TOKEN] [--window 5m] [--json] [--cache]
                  [--fail-on critical|warning|info]

Reads ``GET /admin/doctor?window=...`` (admin token from ``--admin-token`` or
``$KVGATE_ADMIN_TOKEN``) and prints the findings as a table, worst first (``--cache``: the
cache return per tenant and pool instead; ``--json``: the whole report as JSON). Every error
is one line on stderr: exit status 2 for usage (bad flags, no token, a bad window), 1 when
the gateway cannot be reached or refuses. A report printed exits 0 whatever it found, unless
``--fail-on SEVERITY`` is given: then 3 when a finding is that severe or worse.

A gateway of ``server.workers`` > 1 answers each request from one worker (the kernel spreads
connections over them), and each worker's report covers its own requests and history only.
So the doctor asks again, on a new connection each time, until it has every worker's report
(at most `TRIES_PER_WORKER` per worker; ``--timeout`` bounds the whole run, the first report
and the others together), and prints one section per worker, naming any it did not reach;
``--json`` then prints ``{"object": "doctor.workers", "workers": N, "missing": [slots],
"data": [reports]}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from typing import Any, NoReturn

import httpx

from gateway.admin.auth import header_safe
from gateway.cli.admin_http import (
    NOT_ADMIN_PORT,
    NOT_KVGATE,
    NOT_LISTENING,
    TOKEN_HELP,
    client_token,
    not_admin_port,
    url_path_hint,
)
from gateway.cli.parser import suggest
from gateway.doctor import readiness
from gateway.doctor.render import parse_duration, render_cache, render_findings

__all__ = ["main"]

PROG = "kvgate doctor"
REPORT_KEYS = ("window", "history", "worst", "findings", "cache")  # what the renderers read
FAIL_ON = ("critical", "warning", "info")  # worst first, as the report's severities
FOUND = 3  # exit status: a finding at least as severe as --fail-on
MAX_TIMEOUT_S = 86400  # a day: a longer --timeout is a typo, and sockets refuse 1e308
TRIES_PER_WORKER = 8  # 2 workers, each reached at random: all missed one 1 time in 2**15


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        raise _Usage(f"{suggest(self, message)} (see `{PROG} --help`)")


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
    p.add_argument("--fail-on", choices=FAIL_ON,
                   help=f"exit {FOUND} when a finding is this severe or worse (default: exit 0 "
                        "whenever the report is printed)")
    p.add_argument("--timeout", type=float, default=15.0,
                   help="seconds for the whole answer (default %(default)s)")
    return p


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _client() -> httpx.Client:
    """One client for the run: building one costs ~0.2 s (its SSL context), which a client
    per ask spent past the deadline. No keep-alive: each ask is a new connection, which the
    kernel may hand to another worker."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


class _Cutter:
    """Cuts one ask's connection when the run's time is up: httpx's timeouts are per read,
    so a link trickling its headers or body a byte a second would otherwise never time out.
    The socket comes from httpx's ``trace`` extension; shutting it down wakes the read
    blocked on it, which then fails."""

    def __init__(self, left: float) -> None:
        self.cut = False
        self._sock: socket.socket | None = None
        self._timer = threading.Timer(left, self._cut)
        self._timer.daemon = True

    def trace(self, event: str, info: dict[str, Any]) -> None:
        # the TCP connection, then (https) the TLS one wrapping the same descriptor
        if event.endswith((".connect_tcp.complete", ".start_tls.complete")):
            self._sock = info["return_value"].get_extra_info("socket")
            if self.cut:  # connected just as the time ran out
                self._cut()

    def _cut(self) -> None:
        self.cut = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> _Cutter:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _read(
    client: httpx.Client, url: str, token: str | None, window: str | None, deadline: float
) -> tuple[httpx.Response, bytes]:
    """The answer, headers and body, read by ``deadline`` (`time.monotonic`): the report's
    (``window`` given, with the admin token), else ``/readyz``'s (a public page: no token)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpx.ReadTimeout("no time left")
    body = bytearray()
    path, params = ("/admin/doctor", {"window": window}) if window is not None else ("/readyz", {})
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    with _Cutter(left) as cutter:
        try:
            with client.stream("GET", f"{url}{path}", params=params, headers=headers,
                               timeout=left, extensions={"trace": cutter.trace}) as response:
                for chunk in response.iter_bytes():
                    body += chunk
        except httpx.HTTPError:
            if not cutter.cut:
                raise
        if cutter.cut:  # (an answer of unknown length cut short looks whole)
            raise httpx.ReadTimeout("the whole answer took too long")
    return response, bytes(body)


def _fetch(
    client: httpx.Client, url: str, token: str, window: str, deadline: float
) -> dict[str, Any]:
    response, body = _read(client, url, token, window, deadline)
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if response.is_error:
        message = None
        if isinstance(payload, dict):
            message = (payload.get("error") or {}).get("message")
        hint = ""
        if response.status_code == 404:  # kvgate's own 404s say `error.message`
            hint = (" (a kvgate gateway with `kvgate doctor` support?)" if message else
                    f": not a kvgate gateway's answer; check --url: {NOT_KVGATE}")
        if not_admin_port(response.status_code, message):
            hint = f" {NOT_ADMIN_PORT}"
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
        if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
            # (past what a socket's timeout takes, 1e308 was a traceback from the timer thread)
            raise _Usage(f"--timeout must be positive and finite, at most {MAX_TIMEOUT_S} s")
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
    if not header_safe(token):
        # an HTTP header cannot carry it: it was "cannot reach URL: Illegal header value"
        return _fail("the admin token holds a space, a control or a non-ASCII character: "
                     "an HTTP header cannot carry it (check --admin-token or "
                     "KVGATE_ADMIN_TOKEN)", 2)
    url = args.url.rstrip("/")
    try:
        parsed = httpx.URL(url) if url.startswith(("http://", "https://")) else None
    except httpx.InvalidURL:
        parsed = None
    if parsed is None or not parsed.host:
        return _fail(f"--url {args.url!r}: expected http://HOST:PORT", 2)
    if parsed.userinfo:  # httpx sends it as Basic auth instead of the admin token
        return _fail("--url: no user:password@ in it (the admin token goes in --admin-token "
                     "or KVGATE_ADMIN_TOKEN)", 2)
    if hint := url_path_hint(args.url):
        return _fail(hint, 2)
    # one deadline for the whole run: the first report and, with several workers, the others
    # (each ask had a --timeout of its own: the run took up to twice what was asked)
    deadline = time.monotonic() + args.timeout
    with _client() as client:
        return _diagnose(client, args, url, token, deadline)


def _diagnose(
    client: httpx.Client, args: argparse.Namespace, url: str, token: str, deadline: float
) -> int:
    try:
        report = _fetch(client, url, token, args.window, deadline)
    except httpx.TimeoutException:
        return _fail(f"{url} did not answer within {args.timeout:g} s", 1)
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        hint = f"; {NOT_LISTENING}" if isinstance(exc, httpx.ConnectError) else ""
        return _fail(f"cannot reach {url}: {reason}{hint}", 1)
    except RuntimeError as exc:
        return _fail(str(exc), 1)
    workers = _workers(report)
    reports, missing = [report], list[int]()
    if workers > 1:
        reports, missing = _every_worker(client, url, token, args.window, deadline, report,
                                         workers)
    # /readyz's degraded reasons, in the first report (each worker's would say the same)
    readiness.merge(reports[0], _readiness(client, url, deadline, reports[0]["findings"]))
    if workers > 1:
        if args.json:
            print(json.dumps({"object": "doctor.workers", "workers": workers,
                              "missing": missing, "data": reports}, indent=2))
        else:
            render = render_cache if args.cache else render_findings
            print(_workers_note(url, workers, reports, missing, args.timeout))
            print("\n\n".join(render(r, url) for r in reports))
        return _status(reports, args.fail_on)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    elif args.cache:
        print(render_cache(report, url))
    else:
        print(render_findings(report, url))
    return _status([report], args.fail_on)


def _readiness(
    client: httpx.Client, url: str, deadline: float, findings: list[dict[str, Any]]
) -> dict[str, Any]:
    """What the gateway's /readyz says, as findings; one that cannot be read is a finding."""
    try:
        response, body = _read(client, url, None, None, deadline)
    except httpx.TimeoutException:
        return readiness.unread(url, "no answer within --timeout")
    except httpx.HTTPError as exc:
        return readiness.unread(url, type(exc).__name__)
    return readiness.from_readyz(url, response.status_code, body, findings)


def _status(reports: list[dict[str, Any]], fail_on: str | None) -> int:
    """0, or `FOUND` when a finding of any report is at least as severe as ``fail_on``."""
    if fail_on is None:
        return 0
    bar = FAIL_ON.index(fail_on)
    severe = {f.get("severity") for r in reports for f in r["findings"]} & set(FAIL_ON[:bar + 1])
    return FOUND if severe else 0


def _workers(report: dict[str, Any]) -> int:
    workers = report.get("process", {}).get("workers", 1)
    return workers if isinstance(workers, int) else 1


def _slot(report: dict[str, Any]) -> Any:
    """Which worker answered: its slot (its pid from a gateway that does not say)."""
    process = report.get("process", {})
    return process.get("worker") if process.get("worker") is not None else process.get("pid")


def _slot_order(report: dict[str, Any]) -> tuple[int, str]:
    """Workers in numeric order (worker 2 before worker 10); anything not a number after."""
    slot = _slot(report)
    if isinstance(slot, int) and not isinstance(slot, bool):
        return slot, ""
    return sys.maxsize, str(slot)


def _every_worker(
    client: httpx.Client, url: str, token: str, window: str, deadline: float,
    first: dict[str, Any], workers: int,
) -> tuple[list[dict[str, Any]], list[int]]:
    """One report per worker: asked again on new connections until every worker answered,
    `TRIES_PER_WORKER` times per worker at most, by ``deadline`` (the run's). A failed ask
    ends the search (the reports had so far are shown)."""
    seen = {_slot(first): first}
    for _ in range(TRIES_PER_WORKER * workers):
        if len(seen) >= workers or time.monotonic() >= deadline:
            break
        try:
            report = _fetch(client, url, token, window, deadline)
        except (httpx.HTTPError, RuntimeError):
            break
        seen.setdefault(_slot(report), report)
    reports = sorted(seen.values(), key=_slot_order)
    slots = {r.get("process", {}).get("worker") for r in reports}
    if None in slots:  # a gateway that names its workers by pid only: counted, not named
        return reports, []
    return reports, [s for s in range(workers) if s not in slots]


def _workers_note(
    url: str, workers: int, reports: list[dict[str, Any]], missing: list[int], timeout: float
) -> str:
    note = (f"{url} runs {workers} worker processes, each with its own requests and history: "
            f"one report per worker below ({len(reports)} of {workers})")
    if missing:
        note += (f"; worker(s) {', '.join(map(str, missing))} did not answer within "
                 f"{timeout:g} s or {TRIES_PER_WORKER * workers} tries: their requests are not "
                 "in this view")
    return note + "\n" + "-" * 72
