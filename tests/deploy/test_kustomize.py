"""The kustomize subset builder: its own semantics, and agreement with the real kustomize on
every kustomization in deploy/.

The real kustomize's builds are checked in under tests/deploy/expected/ (made with
`kubectl kustomize`), so the comparison runs everywhere, with or without kubectl. Where kubectl
is installed, its build must also equal the checked-in one: a change to deploy/ without the
rebuilt expectation fails, with the command that rebuilds it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy.kustomize_lite import KustomizeError, build, load_docs, merge, resource_key

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = ["base", "pools", "overlays/service", "overlays/sidecar"]
EXPECTED = ROOT / "tests" / "deploy" / "expected"  # `kubectl kustomize deploy/NAME`, per NAME


@pytest.mark.parametrize(
    ("base", "patch", "expected"),
    [
        ({"a": 1, "b": {"c": 2}}, {"b": {"d": 3}}, {"a": 1, "b": {"c": 2, "d": 3}}),
        ({"a": 1, "b": 2}, {"b": None}, {"a": 1}),
        ({"l": [1, 2]}, {"l": [3]}, {"l": [3]}),
        (
            {"c": [{"name": "x", "image": "i"}, {"name": "y"}]},
            {"c": [{"name": "x", "image": "j"}, {"name": "z"}]},
            {"c": [{"name": "x", "image": "j"}, {"name": "y"}, {"name": "z"}]},
        ),
        ({"data": {"k": "old"}}, {"data": {"k": "new"}}, {"data": {"k": "new"}}),
    ],
)
def test_merge(base: dict[str, object], patch: dict[str, object], expected: object) -> None:
    assert merge(base, patch) == expected


def test_unsupported_fields_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(KustomizeError, match="namePrefix"):
        build(tmp_path)


def test_patch_that_matches_nothing_fails(tmp_path: Path) -> None:
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [cm.yaml]\npatches:\n  - patch: |-\n      apiVersion: v1\n"
        "      kind: ConfigMap\n      metadata: {name: b}\n"
    )
    with pytest.raises(KustomizeError, match="matches 0"):
        build(tmp_path)


def _index(docs: list[dict[str, object]]) -> dict[tuple[str, str, str, str], object]:
    return {resource_key(doc): doc for doc in docs}


def _expected(name: str) -> Path:
    return EXPECTED / f"{name.replace('/', '-')}.yaml"


def _rebuild(name: str) -> str:
    return f"kubectl kustomize deploy/{name} > {_expected(name).relative_to(ROOT)}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_same_output_as_the_checked_in_real_kustomize_build(name: str) -> None:
    expected = _expected(name)
    assert expected.is_file(), f"missing {expected}: run `{_rebuild(name)}`"
    assert _index(build(ROOT / "deploy" / name)) == _index(load_docs(expected.read_text()))


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_checked_in_build_is_what_real_kustomize_builds_today(name: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # the comparison above still ran against the checked-in build
        pytest.skip("kubectl is not installed: deploy/ compared with the checked-in "
                    "tests/deploy/expected/ builds only")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / name)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert _index(load_docs(out)) == _index(load_docs(_expected(name).read_text())), (
        f"deploy/{name} changed: rebuild its expectation with `{_rebuild(name)}`")
