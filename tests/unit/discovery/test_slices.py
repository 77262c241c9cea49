"""EndpointSlice → URLs, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.discovery.base import format_url
from gateway.discovery.slices import slice_port, urls_from_slices


def _slice(endpoints: list[dict[str, Any]], ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"name": "s"}, "endpoints": endpoints, "ports": ports}


HTTP = [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9000}]


@pytest.mark.parametrize(
    ("ports", "want", "expected"),
    [
        (HTTP, "http", 8000),
        (HTTP, "metrics", 9000),
        (HTTP, "grpc", None),
        ([{"port": 8080}], "http", 8080),  # one unnamed port: the Service's only port
        ([{"name": "", "port": 8080}], "", 8080),
        ([{"port": 8080}, {"name": "x", "port": 1}], "http", None),
        (HTTP, 7000, 7000),  # a fixed number overrides the slice
        ([], "http", None),
        (None, "http", None),
    ],
)
def test_slice_port(ports: Any, want: str | int, expected: int | None) -> None:
    assert slice_port({"ports": ports}, want) == expected


@pytest.mark.parametrize(
    ("endpoints", "expected"),
    [
        ([{"addresses": ["10.0.0.1"], "conditions": {"ready": True}}], {"http://10.0.0.1:8000"}),
        ([{"addresses": ["10.0.0.1"], "conditions": {"ready": False}}], set()),
        ([{"addresses": ["10.0.0.1"], "conditions": {}}], {"http://10.0.0.1:8000"}),
        ([{"addresses": ["10.0.0.1"]}], {"http://10.0.0.1:8000"}),
        ([{"addresses": [], "conditions": {"ready": True}}], set()),
        (
            [{"addresses": ["10.0.0.1", "10.0.0.2"], "conditions": {"ready": True}}],
            {"http://10.0.0.1:8000"},  # addresses of one endpoint are fungible: one replica
        ),
        ([{"addresses": ["fd00::1"]}], {"http://[fd00::1]:8000"}),
        (
            [{"addresses": ["10.0.0.1"], "conditions": {"ready": False, "serving": True,
                                                        "terminating": True}}],
            set(),  # a terminating pod still serving gets no new requests
        ),
        (
            [{"addresses": ["10.0.0.1"], "conditions": {"ready": True, "serving": True,
                                                        "terminating": True}}],
            set(),  # publishNotReadyAddresses: terminating, though reported ready
        ),
        ([{"addresses": ["10.0.0.1"], "conditions": {"terminating": True}}], set()),
        (
            [{"addresses": ["10.0.0.1"], "conditions": {"ready": True, "terminating": False}}],
            {"http://10.0.0.1:8000"},
        ),
        (None, set()),
    ],
)
def test_ready_endpoints_only(endpoints: Any, expected: set[str]) -> None:
    assert urls_from_slices([_slice(endpoints, HTTP)], "http", "http") == expected


def test_union_over_slices_and_dedup() -> None:
    a = _slice([{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"]}], HTTP)
    b = _slice([{"addresses": ["10.0.0.2"]}, {"addresses": ["10.0.0.3"]}], HTTP)
    urls = urls_from_slices([a, b], "http", "https")
    assert urls == {f"https://10.0.0.{i}:8000" for i in (1, 2, 3)}


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("10.0.0.1", "http://10.0.0.1:80"),
        ("::1", "http://[::1]:80"),
        ("[::1]", "http://[::1]:80"),
        ("vllm-0.vllm.llm.svc", "http://vllm-0.vllm.llm.svc:80"),
    ],
)
def test_format_url(host: str, expected: str) -> None:
    assert format_url("http", host, 80) == expected
