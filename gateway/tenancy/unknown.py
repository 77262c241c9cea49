"""Fields of a stored record this kvgate does not know, kept through a read-modify-write.

A newer kvgate may have written an optional field this one does not know (a rolling upgrade);
stored records are read with such fields ignored (`gateway.tenancy.store`). Writing back what
was read would drop them: the newer gateways would lose the field for good. So the stores
rewrite a record (a tenant's PATCH or salt rotation, a policy PATCH) as the new record plus
every field of the stored one that the model has no place for, at any depth (a field inside
``limits``, inside one pool of the policy). A field the model knows is never taken from the
stored record: what this gateway wrote is what it meant.
"""

from __future__ import annotations

import json
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

__all__ = ["keep_unknown", "merge_unknown"]


def keep_unknown(stored: str | bytes, new: str, model: type[BaseModel]) -> str:
    """`new` (a record's JSON) with the fields of `stored` (the JSON it replaces) that `model`
    does not know; `new` as it is when `stored` is not a JSON object (nothing to keep)."""
    try:
        old = json.loads(stored)
    except ValueError:
        return new
    if not isinstance(old, dict):
        return new
    merged = merge_unknown(old, json.loads(new), model)
    return json.dumps(merged, separators=(",", ":"))


def merge_unknown(old: Any, new: Any, annotation: Any) -> Any:
    """`new` with what of `old` the type `annotation` has no field for (both decoded JSON)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    model = _model(annotation)
    if model is not None:
        out = dict(new)
        for name, value in old.items():
            known = _field(model, name)
            if known is None:
                out.setdefault(name, value)
            elif name in out:
                out[name] = merge_unknown(value, out[name], known)
        return out
    values = _dict_values(annotation)
    if values is None:
        return new
    return {k: merge_unknown(old[k], v, values) if k in old else v for k, v in new.items()}


def _unwrap(annotation: Any) -> list[Any]:
    """The types an annotation may hold: ``Annotated`` and ``X | None`` taken apart."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _unwrap(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [t for arg in get_args(annotation) for t in _unwrap(arg)]
    return [annotation]


def _model(annotation: Any) -> type[BaseModel] | None:
    for t in _unwrap(annotation):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _dict_values(annotation: Any) -> Any:
    for t in _unwrap(annotation):
        if get_origin(t) is dict:
            return get_args(t)[1]
    return None


def _field(model: type[BaseModel], name: str) -> Any:
    """The annotation of `model`'s field stored under `name` (its alias, if it has one)."""
    for field_name, info in model.model_fields.items():
        if name in (field_name, info.alias):
            return info.annotation if info.annotation is not None else Any
    return None
