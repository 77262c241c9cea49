"""One error hierarchy (issue 10, Structure): every error kvgate answers is a class of
`gateway.errors`, each name defined once, and each renders OpenAI's body shape."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TypeVar

import orjson

import gateway
from gateway import errors
from gateway.errors import KvgateError

_T = TypeVar("_T")


def _all_subclasses(cls: type[_T]) -> set[type[_T]]:
    out: set[type[_T]] = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


def test_every_error_class_lives_in_gateway_errors_once() -> None:
    for mod in pkgutil.walk_packages(gateway.__path__, "gateway."):
        if mod.name.endswith("__main__"):
            continue
        importlib.import_module(mod.name)
    classes = _all_subclasses(KvgateError)
    assert {c.__module__ for c in classes} == {"gateway.errors"}
    names = [c.__name__ for c in classes]
    assert len(names) == len(set(names))
    assert set(errors.__all__) >= set(names)


def test_every_error_renders_openai_shape_with_a_code() -> None:
    for cls in _all_subclasses(KvgateError):
        try:
            error = cls("m")
        except TypeError:  # needs more arguments (ModelNotFound, RateLimited)
            continue
        body = orjson.loads(error.body())["error"]
        assert set(body) == {"message", "type", "param", "code"}
        assert body["code"] == (cls.code or cls.status)


def test_rate_limited_says_when_to_retry() -> None:
    error = errors.RateLimited("slow down", retry_after_s=0.2)
    assert (b"retry-after", b"1") in error.headers()
    assert orjson.loads(error.body())["error"]["code"] == "rate_limit_exceeded"


def test_for_status_uses_the_vocabulary() -> None:
    assert errors.for_status(422, "x").type_ == "UnprocessableEntityError"
    assert orjson.loads(errors.for_status(422, "x").body())["error"]["code"] == 422


def test_every_flow_control_shed_says_queue_shed() -> None:
    """429 (a lower band, or past its longest wait) or 503 (a queue full of top-band
    requests): one string code, as the 429 of a tenant's limits has its own."""
    for error in (errors.QueueShed("m", retry_after_s=3), errors.PoolOverloaded("m")):
        assert orjson.loads(error.body())["error"]["code"] == "queue_shed", type(error)
    assert errors.PoolOverloaded("m").status == 503


def test_a_long_model_name_is_echoed_cut_with_its_length() -> None:
    long = "m" * 60_000
    message = orjson.loads(errors.ModelNotFound(long, ["a"]).body())["error"]["message"]
    assert len(message) < 500 and "(60000 characters)" in message
    short = orjson.loads(errors.ModelNotFound("gpt-x").body())["error"]["message"]
    assert short == "The model `gpt-x` does not exist."
