"""A small, strict subset of `kustomize build`, enough for deploy/ and nothing more.

No kustomize binary installs from the registries CI reaches, so tests build the overlays with
this. It supports exactly the fields deploy/ uses and REJECTS any other field, so a
kustomization that starts using more fails here loudly instead of building wrong:

- ``resources``: YAML files (multi-document) and directories holding a kustomization.yaml;
- ``patches``: strategic-merge patches from ``path`` or inline ``patch`` (no ``target``):
  maps merge recursively, ``null`` removes a key, lists of named items (containers, env,
  volumes, ports, ...) merge by ``name``, other lists are replaced, a list holding a
  ``{$patch: replace}`` item replaces the base's list with its other items, and a top-level
  ``$patch: delete`` removes the resource;
- ``namespace``: set on namespaced resources, and on ServiceAccount subjects of (Cluster)
  RoleBindings that have none (as kustomize does);
- ``labels`` with ``pairs`` only (``includeSelectors``/``includeTemplates`` false): added
  to ``metadata.labels``.

Transformers run in kustomize's order: patches, then namespace, then labels. Where kubectl
is installed, tests/deploy/test_kustomize.py checks this builder against `kubectl kustomize`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

__all__ = ["KustomizeError", "build", "load_docs", "resource_key"]

Obj = dict[str, Any]
SUPPORTED = {"apiVersion", "kind", "resources", "patches", "namespace", "labels"}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
    "CustomResourceDefinition", "PriorityClass", "IngressClass",
}


class KustomizeError(Exception):
    pass


def load_docs(text: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def resource_key(obj: Obj) -> tuple[str, str, str, str]:
    meta = obj.get("metadata") or {}
    return (_group(obj["apiVersion"]), obj["kind"], meta.get("namespace", ""), meta["name"])


def build(directory: Path) -> list[Obj]:
    """The resources `kustomize build directory` would emit (order: resource order)."""
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    kust = yaml.safe_load(path.read_text())
    unknown = set(kust) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{path}: unsupported fields {sorted(unknown)}")
    if kust.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{path}: kind must be Kustomization")
    resources = _load_resources(directory, kust.get("resources") or [])
    for patch in kust.get("patches") or []:
        resources = _apply_patch(resources, _patch_docs(directory, patch), path)
    if "namespace" in kust:
        for obj in resources:
            _set_namespace(obj, kust["namespace"])
    for entry in kust.get("labels") or []:
        _add_labels(resources, entry, path)
    return resources


def _load_resources(directory: Path, entries: list[str]) -> list[Obj]:
    out: list[Obj] = []
    seen: set[tuple[str, str, str, str]] = set()
    for entry in entries:
        target = (directory / entry).resolve()
        docs = build(target) if target.is_dir() else load_docs(target.read_text())
        for doc in docs:
            key = resource_key(doc)
            if key in seen:
                raise KustomizeError(f"{directory}: duplicate resource {key}")
            seen.add(key)
            out.append(doc)
    return out


def _patch_docs(directory: Path, patch: Obj) -> list[Obj]:
    if set(patch) - {"path", "patch"} or len(patch) != 1:
        raise KustomizeError(f"{directory}: a patch needs exactly one of path/patch, no target")
    text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
    return load_docs(text)


def _matches(obj: Obj, patch: Obj) -> bool:
    pmeta = patch.get("metadata") or {}
    same = (_group(obj["apiVersion"]), obj["kind"], obj["metadata"]["name"]) == (
        _group(patch["apiVersion"]), patch["kind"], pmeta.get("name"))
    ns = pmeta.get("namespace")
    return same and (ns is None or ns == obj["metadata"].get("namespace"))


def _apply_patch(resources: list[Obj], docs: list[Obj], where: Path) -> list[Obj]:
    for patch in docs:
        hits = [obj for obj in resources if _matches(obj, patch)]
        if len(hits) != 1:
            raise KustomizeError(f"{where}: patch matches {len(hits)} resources: {patch}")
        if patch.get("$patch") == "delete":
            resources = [obj for obj in resources if obj is not hits[0]]
            continue
        body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
        merged = merge(hits[0], body)
        resources = [merged if obj is hits[0] else obj for obj in resources]
    return resources


def merge(base: Any, patch: Any) -> Any:
    """Strategic-merge subset (see the module docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    if isinstance(patch, list) and {"$patch": "replace"} in patch:
        return [copy.deepcopy(item) for item in patch if item != {"$patch": "replace"}]
    if _named_list(base) and _named_list(patch):
        out_list = [copy.deepcopy(item) for item in base]
        index = {item["name"]: i for i, item in enumerate(out_list)}
        for item in patch:
            if item["name"] in index:
                out_list[index[item["name"]]] = merge(out_list[index[item["name"]]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _named_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, dict) and "name" in i for i in value)


def _set_namespace(obj: Obj, namespace: str) -> None:
    if obj["kind"] in CLUSTER_SCOPED:
        return
    obj["metadata"]["namespace"] = namespace
    if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
        for subject in obj.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount" and not subject.get("namespace"):
                subject["namespace"] = namespace


def _add_labels(resources: list[Obj], entry: Obj, where: Path) -> None:
    if set(entry) - {"pairs", "includeSelectors", "includeTemplates"}:
        raise KustomizeError(f"{where}: unsupported labels options {sorted(entry)}")
    if entry.get("includeSelectors") or entry.get("includeTemplates"):
        raise KustomizeError(f"{where}: includeSelectors/includeTemplates are not supported")
    for obj in resources:
        labels = obj["metadata"].setdefault("labels", {})
        labels.update(entry["pairs"])
