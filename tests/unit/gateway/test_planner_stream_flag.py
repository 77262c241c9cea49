"""The routing features' `stream` follows the body's parse (`Planner.prefix_features`): a
`"stream": "false"` string is a whole answer as vLLM reads it, and kvgate's parse says so, but
the features' truth test took it for a stream, so the replica's lease counted a whole answer
as a stream (the silent-replica and stall rules then wait for a first token it never sends)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import orjson

from gateway.body import parse_body
from gateway.planner import Planner
from gateway.tenancy.edge import TenantGate
from gateway.tenancy.principal import Principal
from routing.config import RouterConfig


def _planner() -> Planner:
    # prefix_features reads only the router config and the gate's salt: the rest unneeded
    planner = Planner.__new__(Planner)
    planner._config = RouterConfig()
    planner.gate = cast(TenantGate, SimpleNamespace(salt=lambda principal: "s"))
    return planner


def _features_stream(stream: object) -> tuple[bool, bool]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi " * 40}],
            "stream": stream}
    parsed = parse_body(orjson.dumps(body), "chat")
    principal = cast(Principal, SimpleNamespace(tenant_id="t", tier="free"))
    return parsed.stream, _planner().prefix_features(parsed, principal).stream


def test_the_features_stream_is_the_parsed_bodys() -> None:
    assert _features_stream("false") == (False, False)
    assert _features_stream(True) == (True, True)
    assert _features_stream(False) == (False, False)
