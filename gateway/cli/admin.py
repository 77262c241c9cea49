"""`kvgate admin ...`: a small client for a running gateway's admin API.

    kvgate admin --url URL [--token-env KVGATE_ADMIN_TOKEN] tenants create ID --tier T
    kvgate admin ... tenants list | get ID | delete ID     (list: every tenant, page by page)
    kvgate admin ... tenants update ID [--tier T] [--rpm N|none] [--tpm N|none]
                                       [--max-concurrency N|none]
    kvgate admin ... keys create TENANT | revoke TENANT KEY_ID
    kvgate admin ... policy get | put FILE [--if-match VERSION] | patch FILE|- [--if-match V]
    kvgate admin ... rotate-salt TENANT | audit [--limit N]

The token is the gateway's ``KVGATE_ADMIN_TOKEN``: in its ``id:token,id:token`` form, the first
token is sent. A limit flag's `none` removes the tenant's override (the tier's limit applies
again). `policy put` replaces the whole policy: it takes a policy document or a whole config
file (only its policy sections are sent, and it says so on stderr); `policy patch` sends a JSON
merge patch (RFC 7396, JSON or YAML; `-`: stdin): only what it names changes, `null` removes a
key.

Prints the JSON answer on stdout (for `keys revoke` and `tenants delete`, which the API answers
with an empty 204, a JSON confirmation of what was done); errors go to stderr with exit
status 1 (2 for usage).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import httpx
import yaml

from gateway.admin.writes import IN_FORCE_HEADER
from gateway.cli.admin_http import (
    NOT_ADMIN_PORT,
    NOT_KVGATE,
    NOT_LISTENING,
    TOKEN_HELP,
    client_token,
    not_admin_port,
    url_path_hint,
)
from gateway.cli.parser import Parser
from gateway.config import NAME_RULE, NOT_JUDGED, file_problems
from gateway.config.explain import POLICY_SECTIONS
from gateway.yamlerror import not_utf8, one_line, safe_load

__all__ = ["main"]

VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# a name printed back as given: an environment variable's, by convention (a hex token whose
# first digit is a letter is a valid name too, and was printed in "$<the token> is not set")
SHOWN_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
# an option's value given after `=` in argparse's errors ("ambiguous option: --tok=<value>
# could match --token-env, --token" printed the token)
_OPTION_VALUE = re.compile(r"(--[A-Za-z0-9][A-Za-z0-9-]*)=\S+")
PAGE = 1000  # tenants per `GET /admin/tenants` (the API's most)


def _variable_name(value: str) -> str:
    """A --token-env value: the name of a variable. argparse takes `--token SECRET` for
    `--token-env SECRET` (a prefix of the flag), and the token itself was then printed back in
    "$SECRET is not set"; a value that is no variable's name is refused without echoing it."""
    if not VARIABLE_NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(
            "takes the NAME of the environment variable holding the admin token (e.g. "
            "KVGATE_ADMIN_TOKEN), not the token itself: export the token in a variable and "
            "name it here (what was given is not a variable name; not printed)")
    return value


class _TokenOnCommandLine(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: kvgate admin reads the admin token from the environment, "
                     "not the command line: export it in KVGATE_ADMIN_TOKEN (or name another "
                     "variable with --token-env VAR)")


class _QuietParser(Parser):
    """Its errors say the options misused, never a value given with one (the token may be)."""

    def error(self, message: str) -> NoReturn:
        super().error(_OPTION_VALUE.sub(r"\1=...", message))


def _parser() -> argparse.ArgumentParser:
    p = _QuietParser(prog="kvgate admin", description="kvgate admin API client")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="gateway (or admin port) URL (default %(default)s)")
    p.add_argument(
        "--token-env",
        default="KVGATE_ADMIN_TOKEN",
        type=_variable_name,
        metavar="VAR",
        help=f"environment variable holding the admin token (default %(default)s; "
             f"{TOKEN_HELP})",
    )
    # `kvgate doctor` takes the token itself (--admin-token); `kvgate admin` does not: both
    # spellings are refused by name, without the value (argparse read `--token` as a prefix of
    # --token-env and `--admin-token` as unrecognized, and printed the token back either way)
    p.add_argument("--token", "--admin-token", action=_TokenOnCommandLine, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=_seconds, default=10.0,
                   help="seconds per call to the admin API (default %(default)s)")
    # metavar: argparse names a missing one by it ("required: command", not the dest)
    sub = p.add_subparsers(dest="group", required=True, metavar="command")

    tenants = sub.add_parser("tenants", help="create, update, list, get, delete tenants") \
        .add_subparsers(dest="action", required=True, metavar="action")
    create = tenants.add_parser("create", help="a new tenant (--tier, limit overrides)")
    create.add_argument("id", help=f"the tenant's id: {NAME_RULE}")
    create.add_argument("--tier", default="default",
                        help="a tier of the policy (default: the tier named default)")
    _limit_flags(create, "none: no override, the tier's limit (the default)")
    create.add_argument("--salt-group", help=SALT_GROUP_HELP)
    update = tenants.add_parser("update", help="change a tenant: only the flags given")
    update.add_argument("id", help="the tenant's id")
    update.add_argument("--tier", help="another tier of the policy")
    _limit_flags(update, "none: the tier's limit again")
    update.add_argument("--salt-group", help=SALT_GROUP_HELP)
    tenants.add_parser("list", help="every tenant")
    tenants.add_parser("get", help="a tenant and its key ids").add_argument(
        "id", help="the tenant's id")
    tenants.add_parser("delete", help="a tenant and all its keys").add_argument(
        "id", help="the tenant's id")

    keys = sub.add_parser("keys", help="create (shown once) or revoke API keys") \
        .add_subparsers(dest="action", required=True, metavar="action")
    keys.add_parser("create", help="a new key for TENANT, printed once").add_argument(
        "tenant", help="the tenant's id")
    revoke = keys.add_parser("revoke", help="KEY_ID of TENANT, at once on every gateway")
    revoke.add_argument("tenant", help="the tenant's id")
    revoke.add_argument("key_id", help="the key's id (`keys create` printed it; `tenants get` "
                                       "lists them)")

    policy = sub.add_parser("policy", help="pools, models, tiers, fairness: get, replace, patch") \
        .add_subparsers(dest="action", required=True, metavar="action")
    policy.add_parser("get", help="the policy in force (its version on stderr)")
    put = policy.add_parser("put", help="replace the policy (--if-match: 412 if it changed)")
    put.add_argument("file", help="policy document (JSON or YAML), or a config file: its "
                                  f"{'/'.join(POLICY_SECTIONS)} sections")
    put.add_argument("--if-match", help="the version you edited (from `policy get`)")
    patch = policy.add_parser(
        "patch", help="change only what a JSON merge patch names (null removes a key)")
    patch.add_argument("file", help="the merge patch (JSON or YAML), or - for stdin; e.g. "
                                    "'tiers: {free: {limits: {rpm: 30}}}'")
    patch.add_argument("--if-match", help="412 unless the policy in force is this version")

    sub.add_parser("rotate-salt", help="a new cache salt for TENANT (or its salt group)") \
        .add_argument("tenant", help="the tenant's id")
    sub.add_parser("audit", help="the latest admin changes").add_argument(
        "--limit", type=int, default=100,
        help="entries, newest first: 1 to 1000 (default %(default)s)")
    return p


CLEAR = "none"  # a limit flag's value that removes the override (the API's null)
SALT_GROUP_HELP = ("tenants of one salt group share one cache salt, so each can reuse the "
                   "others' cached prefixes; none: no group (the tenant's own salt)")


def _clears(text: str) -> bool:
    """`none`, as a limit flag takes it: no value (`--salt-group none` joined a group named
    "none", where a user leaving the group wrote what `--rpm none` takes)."""
    return text.strip().lower() == CLEAR


def _limit(text: str) -> int | str:
    """A limit flag's value: a positive integer, or `none` (back to the tier's limit)."""
    if text.strip().lower() == CLEAR:
        return CLEAR
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a positive integer, or none (the tier's limit)")
    return value


def _seconds(text: str) -> float:
    """A call's timeout: 0 failed every call as a connection error ("is kvgate running
    there?"), a negative, nan or inf one ended in a traceback from the socket layer."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of seconds")
    return value


def _limit_flags(p: argparse.ArgumentParser, none: str) -> None:
    """The limit overrides; `none` says what the value none means for this command."""
    p.add_argument("--rpm", type=_limit, help=f"requests per minute; {none}")
    p.add_argument("--tpm", type=_limit, help=f"tokens per minute; {none}")
    p.add_argument("--max-concurrency", type=_limit, help=f"requests in flight; {none}")


def _limits(args: argparse.Namespace) -> dict[str, int | None]:
    """The limit flags given; `none` is sent as null (the override removed)."""
    given = (("rpm", args.rpm), ("tpm", args.tpm), ("max_concurrency", args.max_concurrency))
    return {k: None if v == CLEAR else v for k, v in given if v is not None}


def policy_part(doc: Any, shown: str) -> Any:
    """A config file's policy sections (a note on stderr names what is left out, and warns
    when a gateway restarted with the file would refuse it); any other document as it is,
    for the API to judge."""
    if not isinstance(doc, dict):
        return doc
    other = sorted(k for k in doc if k not in POLICY_SECTIONS)
    if not other or not any(k in doc for k in POLICY_SECTIONS):
        return doc
    print(f"kvgate admin: sending only the policy sections ({', '.join(POLICY_SECTIONS)}); "
          f"left out: {', '.join(map(str, other))} (they take effect at restart)",
          file=sys.stderr)
    problem = file_problems(doc, shown) or ""
    problem, _, note = problem.rpartition(NOT_JUDGED) if NOT_JUDGED in problem else (
        problem, "", "")
    problem = problem.rstrip("\n")
    if note:  # pools not defined here: the rest of the file was judged all the same
        print(f"kvgate admin: note: {NOT_JUDGED}{note}", file=sys.stderr)
    if problem:
        print("kvgate admin: warning: `kvgate serve` would refuse this file at its next "
              f"restart (fix it before one; the policy is sent all the same; judged with this "
              f"shell's KVGATE_* variables, as `kvgate serve --config` reads them): {problem}",
              file=sys.stderr)
    return {k: v for k, v in doc.items() if k in POLICY_SECTIONS}


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, dict[str, str]]:
    """(method, path, json body, extra headers) for the parsed command."""
    group, action = args.group, getattr(args, "action", None)
    if group == "tenants":
        if action == "create":
            body: dict[str, Any] = {"id": args.id, "tier": args.tier, "limits": _limits(args)}
            if args.salt_group and not _clears(args.salt_group):
                body["salt_group"] = args.salt_group
            return "POST", "/admin/tenants", body, {}
        if action == "update":
            patch: dict[str, Any] = {"tier": args.tier} if args.tier is not None else {}
            if args.salt_group is not None:  # none: leave the group (the API's null)
                patch["salt_group"] = None if _clears(args.salt_group) else args.salt_group
            if limits := _limits(args):
                patch["limits"] = limits
            return "PATCH", f"/admin/tenants/{args.id}", patch, {}
        if action == "list":
            return "GET", "/admin/tenants", None, {}
        return ("GET" if action == "get" else "DELETE"), f"/admin/tenants/{args.id}", None, {}
    if group == "keys":
        if action == "create":
            return "POST", f"/admin/tenants/{args.tenant}/keys", None, {}
        return "DELETE", f"/admin/tenants/{args.tenant}/keys/{args.key_id}", None, {}
    if group == "policy":
        if action == "get":
            return "GET", "/admin/policy", None, {}
        headers = {"if-match": f'"{args.if_match}"'} if args.if_match else {}
        if action == "patch":
            patch_doc = safe_load(_text(args.file))  # YAML is a superset of JSON
            return "PATCH", "/admin/policy", patch_doc, headers
        doc = policy_part(safe_load(_text(args.file)), args.file)
        return "PUT", "/admin/policy", doc, headers
    if group == "rotate-salt":
        return "POST", f"/admin/tenants/{args.tenant}/rotate-salt", None, {}
    return "GET", f"/admin/audit?limit={args.limit}", None, {}


def _text(file: str) -> str:
    """A policy file (``-``: standard input) read as UTF-8, as the config file is, whatever
    the locale says."""
    raw = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
    return raw.decode("utf-8")


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        token = client_token(os.environ.get(args.token_env, ""))
    except ValueError as exc:
        print(f"kvgate admin: {exc}".replace("KVGATE_ADMIN_TOKEN", f"${args.token_env}", 1),
              file=sys.stderr)
        return 2
    if not token:
        named = (f"${args.token_env}" if SHOWN_NAME.fullmatch(args.token_env) else
                 "the variable --token-env names (not printed: lower-case, as a token may be)")
        print(f"kvgate admin: {named} is not set: export it with the gateway's admin "
              "token (its KVGATE_ADMIN_TOKEN), or name another variable with --token-env",
              file=sys.stderr)
        return 2
    if args.group == "tenants" and args.action == "update" and not (
            args.tier or args.salt_group or _limits(args)):
        print("kvgate admin: tenants update: nothing to change (give --tier, --rpm, --tpm, "
              "--max-concurrency or --salt-group)", file=sys.stderr)
        return 2
    try:
        method, path, body, headers = _request(args)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        if isinstance(exc, OSError):
            reason = exc.strerror
        elif isinstance(exc, UnicodeDecodeError):
            reason = not_utf8(exc)
        else:
            reason = f"invalid YAML/JSON: {one_line(exc)}"
        print(f"kvgate admin: policy file {args.file}: {reason}", file=sys.stderr)
        return 1
    if not args.url.startswith(("http://", "https://")):
        print(f"kvgate admin: --url {args.url}: give the scheme, e.g. http://{args.url}",
              file=sys.stderr)
        return 2
    if hint := url_path_hint(args.url):
        print(f"kvgate admin: {hint}", file=sys.stderr)
        return 2
    headers["authorization"] = f"Bearer {token}"
    url = args.url.rstrip("/") + path
    try:
        if args.group == "tenants" and args.action == "list":
            response = _every_tenant(url, headers, args.timeout)
        else:
            response = httpx.request(method, url, json=body, headers=headers,
                                     timeout=args.timeout)
    except httpx.HTTPError as exc:
        # the exception's text carries the reason (connection refused, timed out, ...)
        hint = f"; {NOT_LISTENING}" if isinstance(exc, httpx.ConnectError) else ""
        print(f"kvgate admin: {args.url}: {type(exc).__name__}: {exc or 'no detail'}{hint}",
              file=sys.stderr)
        return 1
    return _report(response, _confirmation(args), args.token_env)


def _every_tenant(url: str, headers: dict[str, str], timeout: float) -> httpx.Response:
    """`tenants list`: every tenant, one page after the other (the API answers `PAGE` at
    most), as one list; the first answer that is not a page is returned as it is."""
    data: list[Any] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": PAGE, **({"after": after} if after else {})}
        response = httpx.get(url, params=params, headers=headers, timeout=timeout)
        try:
            page = response.json()
        except ValueError:
            return response
        if response.is_error or not (isinstance(page, dict) and isinstance(page.get("data"),
                                                                          list)):
            return response
        data += page["data"]
        after = page.get("last_id")
        if not (page.get("has_more") and after):
            break
    ends = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    whole = {**page, "data": data, "first_id": ends[0], "last_id": ends[1], "has_more": False}
    return httpx.Response(200, json=whole, request=response.request)


def _confirmation(args: argparse.Namespace) -> dict[str, Any] | None:
    """What an empty success answer confirms, for the commands the API answers with 204."""
    action = getattr(args, "action", None)
    if args.group == "keys" and action == "revoke":
        return {"revoked": True, "tenant": args.tenant, "id": args.key_id}
    if args.group == "tenants" and action == "delete":
        return {"deleted": True, "id": args.id}
    return None


def _error_message(payload: Any) -> str | None:
    """The message of kvgate's (OpenAI-shaped) error answer; None for any other shape."""
    error = payload.get("error") if isinstance(payload, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


def _report(response: httpx.Response, confirmation: dict[str, Any] | None = None,
            token_env: str = "KVGATE_ADMIN_TOKEN") -> int:
    try:
        payload: Any = response.json() if response.content else confirmation
    except ValueError:  # not JSON: --url names another server, or a proxy's error page
        kind = response.headers.get("content-type", "no content-type")
        print(f"kvgate admin: HTTP {response.status_code} from {response.url}: not a kvgate "
              f"admin API answer ({kind}); check --url", file=sys.stderr)
        return 1
    if response.is_error:
        message = _error_message(payload)
        if message is None:  # JSON of another shape: a vLLM replica's port, another service
            body = response.text if len(response.text) <= 80 else response.text[:77] + "..."
            print(f"kvgate admin: HTTP {response.status_code} from {response.url}: not a kvgate "
                  f"admin API answer ({body}); check --url: {NOT_KVGATE}", file=sys.stderr)
            return 1
        if not_admin_port(response.status_code, message):
            message = f"{message} {NOT_ADMIN_PORT}"
        elif response.status_code == 401:
            message = f"{message} (${token_env} is not an admin token of this gateway)"
        print(
            f"kvgate admin: HTTP {response.status_code}: {message or response.text}",
            file=sys.stderr,
        )
        return 1
    if "etag" in response.headers:
        print(f"version: {response.headers['etag'].strip(chr(34))}", file=sys.stderr)
    if response.headers.get(IN_FORCE_HEADER) == "false":
        print("kvgate admin: warning: stored, but the answering gateway could not reload it "
              "(Redis went away): not in force there until Redis answers again (at most "
              "tenancy.max_staleness_s)", file=sys.stderr)
    if payload is not None:
        print(json.dumps(payload, indent=2, sort_keys=True))
    return 0
