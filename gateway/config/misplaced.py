"""Where a field unknown where it was written does exist: a key put in the wrong section
(`server.first_byte_timeout_s`, a top-level `port`, a tier's `rpm` outside its `limits`) was
"unknown field", or a misleading "did you mean body_timeout_s?"; a secret written in a
section (`tenancy.redis_url`) was pointed at a similar field name, never at its variable."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any

from gateway.config.model import KvgateConfig

__all__ = ["SECRET_VARS", "elsewhere", "field_paths", "secret_hint", "unwrap"]

# the fields only the environment sets (gateway.config.env.ENV_SECRETS, the other way round)
SECRET_VARS = {"redis_url": "KVGATE_REDIS_URL", "admin_token": "KVGATE_ADMIN_TOKEN",
               "salt_secret": "KVGATE_SALT_SECRET"}
# how a path names an entry of a mapping or a list it does not share with the field written
PLACEHOLDERS = {"pools": "<pool>", "tiers": "<tier>", "tenants": "<i>"}
MAX_SHOWN = 3


def secret_hint(name: str) -> str | None:
    """For a field named as a secret: where the secret is set instead."""
    var = SECRET_VARS.get(name)
    if var is None:
        return None
    also = " (or tenancy.salt_secret_file)" if name == "salt_secret" else ""
    return f"a secret, read only from the environment variable {var}{also}"


def elsewhere(loc: tuple[str, ...]) -> list[str]:
    """The paths where a field named ``loc[-1]`` exists, an entry's name taken from `loc`
    where the path runs through the same one (`tiers.free.rpm` -> `tiers.free.limits.rpm`)."""
    name = loc[-1]
    found = [path for path in field_paths() if path[-1] == name and name not in SECRET_VARS]
    return [".".join(_filled(path, loc)) for path in found]


def field_paths() -> list[tuple[str, ...]]:
    """Every field's path in the configuration ("*": a mapping's key, a list's index)."""
    return list(_field_paths(KvgateConfig, ()))


def _field_paths(kind: Any, prefix: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """Every field's path under the model `kind`; "*" stands for a mapping's key or a list's
    index."""
    for name, info in getattr(kind, "__pydantic_fields__", {}).items():
        path = (*prefix, name)
        yield path
        inner = unwrap(info.annotation)
        if typing.get_origin(inner) in (dict, list):
            item = unwrap(typing.get_args(inner)[-1])
            yield from _field_paths(item, (*path, "*"))
        else:
            yield from _field_paths(inner, path)


def _filled(path: tuple[str, ...], loc: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for i, part in enumerate(path):
        if part != "*":
            out.append(part)
        elif i < len(loc) - 1 and tuple(loc[:i]) == tuple(out):  # the entry written
            out.append(loc[i])
        else:
            out.append(PLACEHOLDERS.get(path[i - 1], "<name>"))
    return out


def unwrap(kind: Any) -> Any:
    """`X | None` and `Annotated[X, ...]` -> X."""
    while True:
        origin = typing.get_origin(kind)
        if origin is Annotated:
            kind = typing.get_args(kind)[0]
        elif origin in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        else:
            return kind
