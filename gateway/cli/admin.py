"""`kvgate admin ...`: a small client for a running gateway's admin API.

    kvgate admin --url URL [--token-env KVGATE_ADMIN_TOKEN] tenants create ID --tier T
    kvgate admin ... tenants list | get ID | delete ID
    kvgate admin ... keys create TENANT | revoke TENANT KEY_ID
    kvgate admin ... policy get | put FILE [--if-match VERSION]
    kvgate admin ... rotate-salt TENANT | audit [--limit N]

Prints the JSON answer on stdout (for `keys revoke` and `tenants delete`, which the API answers
with an empty 204, a JSON confirmation of what was done); errors go to stderr with exit
status 1 (2 for usage).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate admin", description="kvgate admin API client")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway (or admin port) URL")
    p.add_argument(
        "--token-env",
        default="KVGATE_ADMIN_TOKEN",
        help="environment variable holding the admin token",
    )
    p.add_argument("--timeout", type=float, default=10.0)
    sub = p.add_subparsers(dest="group", required=True)

    tenants = sub.add_parser("tenants").add_subparsers(dest="action", required=True)
    create = tenants.add_parser("create")
    create.add_argument("id")
    create.add_argument("--tier", default="default")
    create.add_argument("--rpm", type=int)
    create.add_argument("--tpm", type=int)
    create.add_argument("--max-concurrency", type=int)
    create.add_argument("--salt-group")
    tenants.add_parser("list")
    for name in ("get", "delete"):
        tenants.add_parser(name).add_argument("id")

    keys = sub.add_parser("keys").add_subparsers(dest="action", required=True)
    keys.add_parser("create").add_argument("tenant")
    revoke = keys.add_parser("revoke")
    revoke.add_argument("tenant")
    revoke.add_argument("key_id")

    policy = sub.add_parser("policy").add_subparsers(dest="action", required=True)
    policy.add_parser("get")
    put = policy.add_parser("put")
    put.add_argument("file", help="policy document (JSON or YAML)")
    put.add_argument("--if-match", help="the version you edited (from `policy get`)")

    sub.add_parser("rotate-salt").add_argument("tenant")
    sub.add_parser("audit").add_argument("--limit", type=int, default=100)
    return p


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, dict[str, str]]:
    """(method, path, json body, extra headers) for the parsed command."""
    group, action = args.group, getattr(args, "action", None)
    if group == "tenants":
        if action == "create":
            limits = {
                k: v
                for k, v in (
                    ("rpm", args.rpm),
                    ("tpm", args.tpm),
                    ("max_concurrency", args.max_concurrency),
                )
                if v is not None
            }
            body: dict[str, Any] = {"id": args.id, "tier": args.tier, "limits": limits}
            if args.salt_group:
                body["salt_group"] = args.salt_group
            return "POST", "/admin/tenants", body, {}
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
        doc = yaml.safe_load(Path(args.file).read_text())  # YAML is a superset of JSON
        headers = {"if-match": f'"{args.if_match}"'} if args.if_match else {}
        return "PUT", "/admin/policy", doc, headers
    if group == "rotate-salt":
        return "POST", f"/admin/tenants/{args.tenant}/rotate-salt", None, {}
    return "GET", f"/admin/audit?limit={args.limit}", None, {}


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    token = os.environ.get(args.token_env, "")
    if not token:
        print(f"kvgate admin: ${args.token_env} is not set", file=sys.stderr)
        return 2
    try:
        method, path, body, headers = _request(args)
    except (OSError, yaml.YAMLError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else f"invalid YAML/JSON ({exc})"
        print(f"kvgate admin: policy file {args.file}: {reason}", file=sys.stderr)
        return 1
    headers["authorization"] = f"Bearer {token}"
    try:
        response = httpx.request(
            method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=args.timeout
        )
    except httpx.HTTPError as exc:
        print(f"kvgate admin: {args.url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    return _report(response, _confirmation(args))


def _confirmation(args: argparse.Namespace) -> dict[str, Any] | None:
    """What an empty success answer confirms, for the commands the API answers with 204."""
    action = getattr(args, "action", None)
    if args.group == "keys" and action == "revoke":
        return {"revoked": True, "tenant": args.tenant, "id": args.key_id}
    if args.group == "tenants" and action == "delete":
        return {"deleted": True, "id": args.id}
    return None


def _report(response: httpx.Response, confirmation: dict[str, Any] | None = None) -> int:
    payload: Any = response.json() if response.content else confirmation
    if response.is_error:
        message = payload.get("error", {}).get("message") if isinstance(payload, dict) else None
        print(
            f"kvgate admin: HTTP {response.status_code}: {message or response.text}",
            file=sys.stderr,
        )
        return 1
    if "etag" in response.headers:
        print(f"version: {response.headers['etag'].strip(chr(34))}", file=sys.stderr)
    if payload is not None:
        print(json.dumps(payload, indent=2, sort_keys=True))
    return 0
