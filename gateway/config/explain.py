"""A failed validation as one line per error, naming the field, the environment variable it
came from, and the field meant when an unknown one is close to it."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.config.env import ENV_SHAPES
from gateway.config.misplaced import MAX_SHOWN, elsewhere, secret_hint, unwrap
from gateway.config.model import KvgateConfig
from gateway.tenancy.models import NAME_PATTERN, NAME_RULE

__all__ = ["POLICY_SECTIONS", "explain", "unknown_hint"]

POLICY_SECTIONS = ("pools", "models", "tiers", "fairness")  # gateway.policy_doc.PolicyDoc

# what a field of the policy sections takes, for a file that wrote it in another shape (a
# model mapped to a pool name, a tenant written as a mapping): pydantic says "a valid
# dictionary" or "a valid list" and not of what ("*": any key)
SHAPES = {
    ("models", "*"): "the pool per tier, e.g. {default: fp8, free: awq}",
    ("tenants",): "a list of tenants, e.g. [{id: acme, tier: premium}]",
    ("pools", "*", "replicas"): "a list of URLs, e.g. [http://10.0.0.1:8000]",
    # a list of named entries, as Kubernetes writes them, where kvgate maps names
    ("pools",): "pool name -> pool, e.g. {fp8: {replicas: [http://10.0.0.1:8000]}}",
    ("tiers",): "tier name -> tier, e.g. {free: {limits: {rpm: 60}}}",
}
FILE_SHAPES = {"list_type": "a list, e.g. [a, b]", "dict_type": "a mapping, e.g. {a: 1}"}
# a value of the wrong type or form: pydantic says what it wanted ("Input should be a valid
# integer") but not what it got, and the policy sections take no quoted number, so `rpm: "60"`
# read "should be a valid integer" of what looks like one
WRONG_VALUE = frozenset({"int_parsing", "int_type", "int_from_float", "float_parsing",
                         "float_type", "bool_parsing", "bool_type", "string_type",
                         # one of a few words (log_format, client_salt): it said which, not
                         # what the file held (`log_format: JSON`)
                         "literal_error", "enum",
                         # a number out of bounds (`server.port: 99999` said "should be less
                         # than or equal to 65535", not what the file held)
                         "less_than_equal", "greater_than_equal", "less_than", "greater_than"})

# a section (or a pool, a tier) given a value that is not a mapping: pydantic names the class
# ("a valid dictionary or instance of ServerConfig"), which no file names
SECTION_TYPES = frozenset({"model_type", "dataclass_type"})


def explain(exc: ValidationError, where: str, env_names: Mapping[tuple[str, ...], str]) -> str:
    """One line per error, naming the field (and the variable it came from, if any)."""
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        unknown = err["type"] in ("extra_forbidden", "unexpected_keyword_argument")
        if unknown:  # (model, dataclass)
            msg = "unknown field" + unknown_hint(loc)
        elif err["type"] == "string_pattern_mismatch" and \
                (err.get("ctx") or {}).get("pattern") == NAME_PATTERN:  # not the regex itself
            msg = f"{err['input']!r} is not a name: {NAME_RULE}"
        elif err["type"] in SECTION_TYPES and "input" in err:
            msg = "Input should be a mapping" + _given(err["input"], strict=False)
            if isinstance(err["input"], str) and ":" in err["input"]:  # `port:9000`
                msg += ": a key is followed by a colon and a space (`port: 9000`)"
        elif err["type"] in WRONG_VALUE and "input" in err:
            msg += _given(err["input"], strict=err["type"] in ("int_type", "float_type"))
        # the variable that set the field, or (an unknown field) put it there: a misspelt
        # section (KVGATE_SERVR__PORT) is reported at `servr`, above the variable's path
        source = next((v for path, v in env_names.items() if loc[:len(path)] == path
                       or (unknown and loc and path[:len(loc)] == loc)), None)
        if source is not None:
            msg += f" (from {source}{ENV_SHAPES.get(err['type'], '')})"
        elif err["type"] in ENV_SHAPES:
            shape = _shape(loc)
            # any other list or mapping: what the file held and the form (`retry_statuses:
            # 500` said "should be a valid list", not of what nor what it got)
            msg += f": {shape}" if shape else _file_shape(err["type"], err.get("input"))
        field = ".".join(loc)
        # a whole-document check (an unknown pool) names its fields in the message itself,
        # as the routing core's checks do ("routing.load_factor must be >= 1.0")
        named = not loc or msg.startswith((f"{field}.", f"{field}:"))
        lines.append(msg if named else f"{field}: {msg}")
    return f"invalid configuration{where}:\n  " + "\n  ".join(lines)


def _file_shape(kind: str, value: Any) -> str:
    """What the file held where a list or a mapping goes, and how to write it: one value
    where a list goes is that value in brackets."""
    if kind == "list_type" and isinstance(value, str | int | float) and value != "":
        written = yaml.safe_dump([value], default_flow_style=True, width=1000).strip()
        if len(written) <= 60:
            return f"{_given(value, strict=False)}: write it as a list, {written}"
    return f"{_given(value, strict=False)}: {FILE_SHAPES[kind]}"


def _given(value: Any, strict: bool) -> str:
    """What the file held, as YAML read it (a quoted number where only a number goes says
    so); a long value cut."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    if strict and isinstance(value, str) and _is_number(value):
        return f" (got the string {text}: write the number without quotes)"
    return f" (got {text})"


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _shape(loc: tuple[str, ...]) -> str | None:
    for pattern, shape in SHAPES.items():
        if len(pattern) == len(loc) and all(
                p in ("*", part) for p, part in zip(pattern, loc, strict=True)):
            return shape
    return None


def unknown_hint(loc: tuple[str, ...], *, policy: bool = False) -> str:
    """What an unknown field was meant to be: a secret's variable, the section (or the
    tier's `limits`) where a field of that name is, else a field of this model close to it.
    `policy`: in a policy document (the admin API's), where only its sections go."""
    if secret := secret_hint(loc[-1]):
        return f" ({secret})"
    if policy and len(loc) == 1 and loc[0] in KvgateConfig.model_fields:
        return (f" (not a policy section: the policy is {', '.join(POLICY_SECTIONS)}; "
                f"{loc[0]} is read from the configuration at start)")
    paths = [p for p in elsewhere(loc) if not policy or p.split(".")[0] in POLICY_SECTIONS]
    if paths:
        shown = " or ".join(paths[:MAX_SHOWN]) + (" or ..." if len(paths) > MAX_SHOWN else "")
        return f" (it belongs at {shown})"
    names = [n for n in _field_names(loc[:-1]) if not secret_hint(n)]
    if policy and len(loc) == 1:
        names = [n for n in names if n in POLICY_SECTIONS]
    close = difflib.get_close_matches(loc[-1], names, n=1)
    # a part of a longer name (`model` for `served_model`) is too far from it for difflib
    close = close or [n for n in names if loc[-1] in n.split("_")][:1]
    if close:
        return f" (did you mean {close[0]}?)"
    # nothing close (`urls` for a pool's replicas): the fields that go here, not a bare
    # "unknown field" that left the user to find them in examples/kvgate.yaml
    return f" (known here: {', '.join(names)})" if 0 < len(names) <= MAX_KNOWN else ""


MAX_KNOWN = 20  # more fields than this (none has so many) are not listed


def _field_names(loc: tuple[str, ...]) -> list[str]:
    """The field names of the model at `loc` in the configuration ([] when not a model)."""
    kind: Any = KvgateConfig
    for part in loc:
        model_fields = getattr(kind, "__pydantic_fields__", None)
        if model_fields is not None:
            if part not in model_fields:
                return []
            kind = model_fields[part].annotation
        elif typing.get_origin(kind) in (dict, list):
            kind = typing.get_args(kind)[-1]  # a pool's or a list item's model
        else:
            return []
        kind = unwrap(kind)
    return list(getattr(kind, "__pydantic_fields__", {}))
