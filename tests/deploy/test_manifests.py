"""Every manifest in deploy/ validated offline against the Kubernetes JSON schemas shipped in
the `kubernetes-validate` package (strict: unknown fields fail), every overlay built, and the
properties operators rely on (probes, security, RBAC, config ↔ Services) checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import load_config
from gateway.discovery import KubernetesConfig, parse_discovery
from tests.deploy.kustomize_lite import build, load_docs

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = kubernetes_validate.latest_version()  # the newest schemas the package ships
OVERLAYS = ["overlays/service", "overlays/sidecar"]
BUILDS = ["base", "pools", *OVERLAYS]
NOT_MANIFESTS = {"kustomization.yaml"}
PATCH_FILES = {"gateway-replicas.yaml", "config-dns.yaml",  # partial: validated once built
               "epp-deployment.yaml", "pool-label.yaml"}
# CRDs the schemas do not cover: validated in test_epp_overlay.py
CRD_GROUPS = {"inference.networking.k8s.io", "gateway.networking.k8s.io"}
# vLLM engine/server flags the pools use; a typo here would crash the pod at start.
KNOWN_VLLM_FLAGS = {
    "--served-model-name", "--host", "--port", "--enable-prefix-caching", "--max-model-len",
    "--gpu-memory-utilization", "--tensor-parallel-size", "--quantization", "--kv-cache-dtype",
    "--scheduling-policy", "--enable-prompt-tokens-details", "--max-num-queued-reqs",
}


def built(name: str) -> list[dict[str, Any]]:
    return build(DEPLOY / name)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def manifest_files() -> list[Path]:
    files = sorted(p for p in DEPLOY.rglob("*.yaml")
                   if p.parent.name not in {"prometheus", "envoy"})  # envoy/: not Kubernetes
    return [p for p in files if p.name not in NOT_MANIFESTS | PATCH_FILES]


def test_schemas_are_local() -> None:
    # The check must run without a network: the package carries the schemas it validates with.
    schema_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    assert any(schema_dir.glob(f"v{K8S_VERSION}*")), K8S_VERSION


def test_strict_validation_catches_an_unknown_field() -> None:
    doc = load_docs((DEPLOY / "base" / "service.yaml").read_text())[0]
    doc["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_file_validates(path: Path) -> None:
    docs = load_docs(path.read_text())
    assert docs
    for doc in docs:
        if doc["apiVersion"].split("/")[0] not in CRD_GROUPS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", BUILDS)
def test_every_build_validates(name: str) -> None:
    docs = built(name)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "llm"


def _kvgate_containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) for every kvgate container in a build."""
    out = []
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        spec = doc["spec"]["template"]["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if c["image"].startswith("kvgate:"):
                out.append((spec, c))
    return out


@pytest.mark.parametrize("name", OVERLAYS)
def test_kvgate_runs_locked_down_with_its_secrets(name: str) -> None:
    found = _kvgate_containers(built(name))
    assert len(found) == 1
    pod, c = found[0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    env = {e["name"]: e for e in c["env"]}
    assert env["KVGATE_CONFIG"]["value"] == "/etc/kvgate/config.yaml"
    for var in ("KVGATE_ADMIN_TOKEN", "KVGATE_SALT_SECRET", "KVGATE_REDIS_URL"):
        assert env[var]["valueFrom"]["secretKeyRef"]["name"] == "kvgate-secrets"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/etc/kvgate" in mounts


def test_service_overlay_gateway_shape() -> None:
    docs = built("overlays/service")
    dep = find(docs, "Deployment", "kvgate")
    assert "replicas" not in dep["spec"]  # the HPA's, below (test_deploy2_hpa_owns_replicas)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    svc = find(docs, "Service", "kvgate")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    pdb = find(docs, "PodDisruptionBudget", "kvgate")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    hpa = find(docs, "HorizontalPodAutoscaler", "kvgate")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "kvgate"
    assert hpa["spec"]["minReplicas"] >= 2


def test_discovery_rbac_is_least_privilege() -> None:
    docs = built("overlays/service")
    role = find(docs, "Role", "kvgate-discovery")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    binding = find(docs, "RoleBinding", "kvgate-discovery")
    assert binding["roleRef"]["name"] == "kvgate-discovery"
    sa = find(docs, "Deployment", "kvgate")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "llm"}]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def _config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    text = find(docs, "ConfigMap", "kvgate-config")["data"]["config.yaml"]
    raw: dict[str, Any] = yaml.safe_load(text)
    return raw


def _vllm_args(docs: list[dict[str, Any]], service: str) -> list[str]:
    svc = find(docs, "Service", service)
    assert svc["spec"]["clusterIP"] == "None"  # headless: discovery sees every pod
    selector = svc["spec"]["selector"].items()
    dep = [d for d in docs if d["kind"] == "Deployment"
           and d["spec"]["template"]["metadata"]["labels"].items() >= selector]
    assert len(dep) == 1
    (c,) = dep[0]["spec"]["template"]["spec"]["containers"]
    assert dep[0]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    args: list[str] = c["args"]
    return args


@pytest.mark.parametrize("name", OVERLAYS)
def test_config_pools_point_at_real_vllm_services(name: str, tmp_path: Path) -> None:
    docs = built(name)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(find(docs, "ConfigMap", "kvgate-config")["data"]["config.yaml"])
    policy = load_config(str(config_file), environ={})  # the gateway's own loader
    for pool_name, pool in policy.pools.items():
        assert pool.discovery, pool_name
        disc = parse_discovery(pool.discovery)
        service = disc.service if isinstance(disc, KubernetesConfig) else disc.name.split(".")[0]
        args = _vllm_args(docs, service)
        flags = dict(a.partition("=")[::2] for a in args if a.startswith("--"))
        assert set(flags) <= KNOWN_VLLM_FLAGS, set(flags) - KNOWN_VLLM_FLAGS
        assert flags["--served-model-name"] == pool.served_model
        required = {"--enable-prefix-caching", "--max-model-len", "--gpu-memory-utilization"}
        assert required <= set(flags)
        assert (flags.get("--scheduling-policy") == "priority") == pool.priority
        port = find(docs, "Service", service)["spec"]["ports"][0]
        if isinstance(disc, KubernetesConfig):
            assert disc.port == port["name"]
        else:
            assert disc.port == port["port"]


def test_fp8_and_awq_pools() -> None:
    docs = built("pools")
    fp8 = _vllm_args(docs, "vllm-fp8")
    assert {"--quantization=fp8", "--kv-cache-dtype=fp8"} <= set(fp8)
    awq = _vllm_args(docs, "vllm-awq")
    assert any(a.startswith("--quantization=awq") for a in awq)
    assert not any(a.startswith("--kv-cache-dtype") for a in awq)


def test_sidecar_has_no_shared_gateway_and_listens_on_loopback() -> None:
    docs = built("overlays/sidecar")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for gone in [("Deployment", "kvgate"), ("Service", "kvgate"),
                 ("HorizontalPodAutoscaler", "kvgate"), ("Role", "kvgate-discovery")]:
        assert gone not in kinds
    assert _config(docs)["server"]["host"] == "127.0.0.1"
    app = find(docs, "Deployment", "chat-app")["spec"]["template"]["spec"]
    (sidecar,) = app["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    env = {e["name"]: e.get("value") for e in app["containers"][0]["env"]}
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8000/v1"
