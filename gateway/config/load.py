"""Building the effective configuration: the file, then the environment, then the flags,
validated as a whole (`load_config`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.config.env import ENV_PREFIX, env_overrides, env_path
from gateway.config.explain import explain
from gateway.config.misplaced import SECRET_VARS
from gateway.config.model import KvgateConfig
from gateway.errors import ConfigError
from gateway.yamlerror import not_utf8, one_line, safe_load

__all__ = ["NOT_JUDGED", "NO_POOLS", "QUICK_SOURCE", "file_problems", "load_config"]

NO_POOLS = "pools: at least one pool is required"
NOT_JUDGED = "not judged: "  # how `file_problems` begins what it could not judge


def deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_file(path: str, shown: str) -> dict[str, Any]:
    """The file's mapping; an error names it as `shown` (the path, and where it came from)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = safe_load(f)  # a YAML error then names the file, line and column
    except OSError as exc:
        raise ConfigError(f"config file {shown}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # e.g. saved as UTF-16, or not the YAML file at all
        raise ConfigError(f"config file {shown}: {not_utf8(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {shown}: invalid YAML: {one_line(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {shown}: top level must be a mapping")
    return data


def _no_secrets(raw: Mapping[str, Any], shown: str) -> None:
    """Secrets come from the environment only (a file sits in a ConfigMap, in git): one
    written in the file was taken, quietly, where the documentation said it never is."""
    for key, var in SECRET_VARS.items():
        if key in raw:
            also = " (or tenancy.salt_secret_file)" if key == "salt_secret" else ""
            raise ConfigError(f"config file {shown}: {key}: secrets are read only from the "
                              f"environment: set {var}{also} instead, and remove {key} from "
                              "the file")


def load_config(
    path: str | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    quick: bool = False,
) -> KvgateConfig:
    """Build the effective config; raises `ConfigError` naming the offending field.

    `path=None` falls back to ``KVGATE_CONFIG``; ``""`` means no file. `quick` (the
    ``--upstream`` form) ignores file and environment pools/models: the flags define them,
    but for the settings of its pool, ``default``, from ``KVGATE_POOLS__DEFAULT__*``.
    """
    env = os.environ if environ is None else environ
    from_env = path is None
    if path is None:
        path = env.get("KVGATE_CONFIG") or None
    # a variable left set in the shell names a file no command line shows: say where it is from
    raw: dict[str, Any] = {}
    if path:
        shown = f"{path} (from KVGATE_CONFIG)" if from_env else path
        raw = _read_file(path, shown)
        _no_secrets(raw, shown)
        # a section line with nothing under it (every field of a copied example commented
        # out) is that section's defaults: it was "server: Input should be a mapping (got None)"
        raw = {key: value for key, value in raw.items() if value is not None}
    raw = deep_merge(raw, env_overrides(env))
    if quick:
        raw.pop("pools", None)
        raw.pop("models", None)
        raw = deep_merge(raw, _quick_pool_env(env_overrides(env)))
    raw = deep_merge(raw, overrides or {})
    env_names = {tuple(env_path(name)): name for name in env
                 if name.startswith(ENV_PREFIX) and "__" in name}
    if quick:  # its one pool comes from the flag: a bad URL there named a pool never written
        env_names[("pools",)] = "--upstream"
    try:
        cfg = KvgateConfig.model_validate(raw)
    except ValidationError as exc:
        where = f" in {path} (or its KVGATE_* overrides)" if path else ""
        raise ConfigError(explain(exc, where, env_names)) from None
    if not cfg.pools:
        raise ConfigError(f"{NO_POOLS} in {path} (or use --upstream URL)" if path else
                          f"{NO_POOLS}: no configuration file given (--config FILE, or set "
                          "KVGATE_CONFIG), or use --upstream URL")
    try:
        cfg.routing.router_config()
    except ValueError as exc:  # the routing core's own checks name the field
        raise ConfigError(f"invalid configuration:\n  {exc}") from None
    cfg.source = _source(path, from_env=from_env, quick=quick)
    return cfg


def file_problems(raw: Mapping[str, Any], shown: str,
                  environ: Mapping[str, str] | None = None) -> str | None:
    """Why `kvgate serve --config` would refuse this parsed config file with this process's
    ``KVGATE_*`` environment (`environ`), or None: `kvgate admin policy put` sends a file's
    policy sections only, and a typo elsewhere in it would surface only at the next restart,
    as a crash loop. Pools the file's models or tiers name but neither it nor the environment
    defines are not judged a problem: `kvgate serve` may take them from ``KVGATE_POOLS__*``
    where it runs (it was "unknown pool" for every gateway whose pools come from there), and
    the answer says what was not judged."""
    env = os.environ if environ is None else environ
    raw = {key: value for key, value in raw.items() if value is not None}
    merged = deep_merge(raw, env_overrides(env))
    env_names = {tuple(env_path(name)): name for name in env
                 if name.startswith(ENV_PREFIX) and "__" in name}
    note = None
    if missing := _undefined_pools(merged):
        names = ", ".join(map(repr, missing))
        note = (f"{NOT_JUDGED}pool(s) {names}: {shown} names them, but neither it nor this "
                "shell's KVGATE_POOLS__* variables define them; `kvgate serve` takes pools from "
                "those variables where it runs (or from --upstream, which reads no file). The "
                "rest of the file was judged with a placeholder for each")
        # the rest of the file is judged still (a secret in it, `server.prot`): a placeholder
        # pool for each missing name, one address apiece (replicas must be distinct)
        pools = dict(merged["pools"]) if isinstance(merged.get("pools"), Mapping) else {}
        for i, name in enumerate(missing):
            pools[name] = {"replicas": [f"http://placeholder.invalid:{1 + i}"]}
        merged = {**merged, "pools": pools}
    try:
        _no_secrets(raw, shown)
        KvgateConfig.model_validate(merged).routing.router_config()
    except ValidationError as exc:
        problem = explain(exc, f" in {shown} (or its KVGATE_* overrides)", env_names)
    except ConfigError as exc:
        problem = str(exc)
    except ValueError as exc:  # the routing core's own checks name the field
        problem = f"invalid configuration in {shown}:\n  {exc}"
    else:
        return note
    return problem if note is None else f"{problem}\n{note}"  # the note last, on its line


def _undefined_pools(raw: Mapping[str, Any]) -> list[str]:
    """The pools a raw configuration's models and tiers name that its `pools` lacks."""
    pools = raw.get("pools") if isinstance(raw.get("pools"), Mapping) else {}
    named: set[str] = set()
    for per_tier in (raw.get("models") or {}).values() if isinstance(
            raw.get("models"), Mapping) else ():
        if isinstance(per_tier, Mapping):
            named |= {p for p in per_tier.values() if isinstance(p, str)}
    for tier in (raw.get("tiers") or {}).values() if isinstance(raw.get("tiers"), Mapping) else ():
        if isinstance(tier, Mapping):
            named |= {tier[k] for k in ("spill_to", "borrow_from") if isinstance(tier.get(k), str)}
    return sorted(named - set(pools or {}))


QUICK_POOL = "default"
QUICK_SOURCE = "--upstream (the quick form) and KVGATE_* environment"


def _quick_pool_env(from_env: Mapping[str, Any]) -> dict[str, Any]:
    """The quick form's pool settings from ``KVGATE_POOLS__DEFAULT__*`` (its replicas are the
    flag's): without them a replica started with vLLM's ``--api-key`` could not be reached
    (``KVGATE_POOLS__DEFAULT__API_KEY_ENV`` was dropped with the rest of the pools, while the
    log said to set the pool's ``api_key_env``)."""
    pools = from_env.get("pools")
    pool = pools.get(QUICK_POOL) if isinstance(pools, Mapping) else None
    if not isinstance(pool, Mapping):
        return {}
    kept = {key: value for key, value in pool.items() if key not in ("replicas", "discovery")}
    return {"pools": {QUICK_POOL: kept}} if kept else {}


def _source(path: str | None, *, from_env: bool, quick: bool) -> str:
    """Where a configuration came from, in a few words, for the start-up line."""
    if quick:
        return QUICK_SOURCE
    if path:
        return f"{path} (from KVGATE_CONFIG)" if from_env else path
    return "defaults and KVGATE_* environment, no file"
