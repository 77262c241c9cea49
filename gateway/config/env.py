"""The environment's part of the configuration: ``KVGATE_<SECTION>__<KEY>`` overrides, the
secrets (``KVGATE_REDIS_URL``, ...), and a warning for ``KVGATE_*`` variables that are none
of these."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any

import yaml

from gateway.config.misplaced import SECRET_VARS, field_paths
from gateway.config.model import KvgateConfig

__all__ = ["ENV_PREFIX", "ENV_SHAPES", "env_overrides", "env_path", "quick_unread_env",
           "unknown_env"]

ENV_PREFIX = "KVGATE_"
# Environment variables with a meaning of their own (not section overrides).
ENV_SECRETS = {"KVGATE_REDIS_URL": "redis_url", "KVGATE_ADMIN_TOKEN": "admin_token",
               "KVGATE_SALT_SECRET": "salt_secret"}
# every other KVGATE_ variable something reads (no section override): the config file, and
# scripts/setup, the test suite's log and loadtest/granian_app.py's benchmark settings
ENV_OTHERS = frozenset({"KVGATE_CONFIG", "KVGATE_EXTRAS", "KVGATE_SKIP_REDIS",
                        "KVGATE_TEST_LOG", "KVGATE_BENCH_UPSTREAMS", "KVGATE_BENCH_MODEL"})

# a variable's value is read as YAML: how to write what a field of these types takes
ENV_SHAPES = {"list_type": ", a list: write it as YAML, e.g. '[a, b]'",
              "dict_type": ", a mapping: write it as YAML, e.g. '{a: 1}'"}


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    node[path[-1]] = value


def env_path(name: str) -> list[str]:
    return [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVGATE_SERVER__PORT=9000`` -> {"server": {"port": 9000}} (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if name in ENV_SECRETS:
            if raw:  # an empty variable means "not set"
                out[ENV_SECRETS[name]] = raw
        elif name.startswith(ENV_PREFIX) and "__" in name:
            try:
                value = yaml.safe_load(raw) if raw else raw
            except yaml.YAMLError:
                value = raw
            _set_path(out, env_path(name), value)
    return out


def unknown_env(cfg: KvgateConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning naming each ``KVGATE_*`` variable that is not a setting (e.g. a single
    underscore: ``KVGATE_SERVER_PORT``; an unknown ``__`` field is an error already). Not
    "ignored": something else may read it (a pool's `api_key_env` known only to the stored
    policy, `kvgate admin --token-env`)."""
    env = os.environ if environ is None else environ
    known = ENV_OTHERS | ENV_SECRETS.keys() | {p.api_key_env for p in cfg.pools.values()}
    stray = sorted(name for name in env if name.startswith(ENV_PREFIX)
                   and "__" not in name and name not in known)
    out = []
    for name in stray:
        meant = " or ".join(_meant(name))
        hint = f"did you mean {meant}?" if meant else (
            "if meant as one, check the spelling: section and field are joined by two "
            "underscores, as in KVGATE_SERVER__PORT")
        out.append(f"kvgate: warning: {name}: not a kvgate setting ({hint})")
    return out


def quick_unread_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning naming each pools or models variable the quick form (`--upstream`: one pool,
    `default`, of the flag's replicas) does not read: it dropped them without a word."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = env_path(name)
        own = path[1:2] == ["default"] and path[2:3] not in (["replicas"], ["discovery"])
        if path[:1] == ["models"] or (path[:1] == ["pools"] and not own):
            out.append(f"kvgate: warning: {name} is not read with --upstream (the quick form: "
                       "one pool, default, of the flag's replicas; its other settings are "
                       "KVGATE_POOLS__DEFAULT__<FIELD>)")
    return out


def _meant(name: str) -> list[str]:
    """The section variables a stray one was likely meant as: one underscore where two go
    (KVGATE_SERVER_PORT), or the section left out (KVGATE_PORT: KVGATE_SERVER__PORT or
    KVGATE_EPP__PORT)."""
    rest = name[len(ENV_PREFIX):].lower()
    paths = [p for p in field_paths() if len(p) == 2 and "*" not in p]
    split = [p for p in paths if f"{p[0]}_{p[1]}" == rest]
    found = split or [p for p in paths if p[1] == rest and p[1] not in SECRET_VARS]
    if found:
        return [f"{ENV_PREFIX}{p[0].upper()}__{p[1].upper()}" for p in found[:3]]
    # a variable of its own misspelt (KVGATE_REDIS, KVGATE_ADMIN_TOKENS)
    return difflib.get_close_matches(name, [*ENV_SECRETS, "KVGATE_CONFIG"], n=1, cutoff=0.8)
