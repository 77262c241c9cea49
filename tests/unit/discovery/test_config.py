"""Discovery config parsing and the in-cluster API server address, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.discovery import (
    DiscoveryConfigError,
    DnsConfig,
    KubernetesConfig,
    KubernetesDiscovery,
    build_discovery,
    parse_discovery,
)
from gateway.discovery.kubernetes import api_server_url


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "exactly one mode"),
        ({"kubernetes": {"service": "a"}, "dns": {"name": "a"}}, "exactly one mode"),
        ({"consul": {}}, "unknown mode 'consul'"),
        ({"kubernetes": {}}, "discovery.kubernetes.service"),
        ({"kubernetes": {"service": "a", "resync_seconds": 0}}, "kubernetes.resync_seconds"),
        ({"kubernetes": {"service": "a", "bogus": 1}}, "discovery.kubernetes.bogus"),
        ({"dns": {"name": "a", "port": 70000}}, "discovery.dns.port"),
        ({"dns": {"name": "a", "scheme": "ftp"}}, "discovery.dns.scheme"),
        # a misspelt required field: the typo is named, not the "Field required" it causes
        ({"dns": {"nme": "a"}}, r"discovery\.dns\.nme: unknown field \(did you mean name\?\)"),
        ({"kubernetes": {"servce": "a"}}, r"kubernetes\.servce: unknown field \(did you mean "
                                          r"service\?\)"),
        ({"dns": {"name": "a", "zzz": 1}}, r"discovery\.dns\.zzz: unknown field$"),
    ],
)
def test_bad_config_names_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(DiscoveryConfigError, match=message):
        parse_discovery(raw)


def test_defaults() -> None:
    k8s = parse_discovery({"kubernetes": {"service": "vllm-fp8"}})
    assert isinstance(k8s, KubernetesConfig)
    assert (k8s.port, k8s.scheme, k8s.namespace) == ("http", "http", None)
    dns = parse_discovery({"dns": {"name": "vllm-awq.llm.svc.cluster.local"}})
    assert isinstance(dns, DnsConfig)
    assert (dns.port, dns.interval_seconds) == (8000, 5.0)


@pytest.mark.parametrize(
    ("api_server", "env", "expected"),
    [
        (None, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
         "https://10.96.0.1:443"),
        (None, {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"},
         "https://[fd00::1]:6443"),
        ("http://127.0.0.1:8001/", {"KUBERNETES_SERVICE_HOST": "10.96.0.1",
                                    "KUBERNETES_SERVICE_PORT": "443"}, "http://127.0.0.1:8001"),
    ],
)
def test_api_server_url(api_server: str | None, env: dict[str, str], expected: str) -> None:
    config = KubernetesConfig(service="s", api_server=api_server)
    assert api_server_url(config, env) == expected


def test_no_api_server_outside_a_cluster_is_a_config_error() -> None:
    with pytest.raises(DiscoveryConfigError, match="KUBERNETES_SERVICE_HOST"):
        build_discovery("p", {"kubernetes": {"service": "s"}}, lambda pool, urls: None, env={})


def test_namespace_defaults_to_default_without_a_service_account(tmp_path: Any) -> None:
    config = KubernetesConfig(service="s", api_server="http://127.0.0.1:1",
                              namespace_path=str(tmp_path / "absent"))
    source = KubernetesDiscovery("p", config, lambda pool, urls: None, env={})
    assert source.collection_url.endswith("/namespaces/default/endpointslices")
