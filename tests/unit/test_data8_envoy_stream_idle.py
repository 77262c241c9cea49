"""The shipped Envoy bootstraps bound a stream whose replica froze after it started.

Behind Envoy the picker ends such a stream at `upstream.idle_timeout_s` (it sees the answer's
bytes, and answers when none came in time); when it cannot (it is gone, and Envoy lets
requests through without it), Envoy's connection manager's `stream_idle_timeout` is what ends
it. Each shipped config must set one: bounded (Envoy's 0 disables it: the stream would stay
open until the route's 30 minutes), above the per-try idle timeout and kvgate's own idle
timeout (else Envoy's 408 comes before the picker's 504 or error event), below the route's
total, and what `kvgate envoy` renders for the same settings (docs/envoy.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config.sections import UpstreamConfig
from gateway.epp.envoy import envoy_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "envoy"


def _seconds(value: str) -> float:
    assert value.endswith("s"), value
    return float(value[:-1])


def _manager(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    manager: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-fallback.yaml"])
def test_the_shipped_config_bounds_a_frozen_stream(name: str) -> None:
    manager = _manager(yaml.safe_load((DEPLOY / name).read_text()))
    idle = _seconds(manager["stream_idle_timeout"])
    up = UpstreamConfig()
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    streamed = routes[-1]["route"]  # (the first: whole answers, marked by the picker)
    per_try = _seconds(streamed["retry_policy"]["per_try_idle_timeout"])
    assert idle > 0
    assert idle > per_try and idle > up.idle_timeout_s
    assert idle <= _seconds(streamed["timeout"])
    rendered = _manager(envoy_config(listen_port=8080, picker="127.0.0.1:9002"))
    assert manager["stream_idle_timeout"] == rendered["stream_idle_timeout"]
