"""The real `kvgate` command on a new user's first mistakes: `kvgate config` without its
command, and a config file with a key given twice or a boolean where a number goes, at
`kvgate config check` and at `kvgate serve` alike: one line naming the place, a non-zero exit,
no traceback, and serve never listens."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.procs import KVGATE, ROOT, free_port

POOLS = "pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"
ENV = {**os.environ, "KVGATE_SALT_SECRET": "s" * 32, "KVGATE_ADMIN_TOKEN": "t" * 32}


def kvgate(*argv: str) -> subprocess.CompletedProcess[str]:
    """The command's outcome; one still running after 30 s (a serve that started) is killed
    and fails the test."""
    return subprocess.run([*KVGATE, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=30, env=ENV)


def test_config_without_its_command_names_the_command() -> None:
    """argparse named the missing one by its variable ("required: action")."""
    result = kvgate("config")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "kvgate config: error: the following arguments are required: command")
    assert "check" in kvgate("config", "--help").stdout


@pytest.mark.parametrize(("text", "line"), [
    # the first server section (its port) was dropped without a word
    (f"server:\n  port: 9000\n{POOLS}server:\n  host: 127.0.0.1\n",
     "invalid YAML: the key 'server' is repeated (only one would count) at line 5, column 1 "
     "(first given at line 1, column 1)"),
    # read as 0 (and `port: true` as port 1; --port below would win over that one)
    (f"{POOLS}upstream:\n  retry_budget_min: no\n",
     "upstream.retry_budget_min: a boolean where a number goes (YAML reads true/false, yes/no "
     "and on/off as booleans): write the number"),
])
@pytest.mark.parametrize("command", ["check", "serve"])
def test_a_config_mistake_is_one_line_at_check_and_serve(
        tmp_path: Path, text: str, line: str, command: str) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(text)
    port = str(free_port())
    result = (kvgate("config", "check", str(path)) if command == "check" else
              kvgate("serve", "--config", str(path), "--host", "127.0.0.1", "--port", port))
    assert result.returncode == 2, result.stderr
    assert line in result.stderr
    assert "Traceback" not in result.stderr and "listening on" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["serve", "epp", "envoy"])
def test_a_bad_upstream_url_is_named_as_the_flag(command: str) -> None:
    """The quick form's pool is `default`, a name the user never wrote: the error named only
    `pools.default`."""
    result = kvgate(command, "--upstream", "127.0.0.1:8000")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "  pools.default: replica URL must start with http:// or https://: '127.0.0.1:8000' "
        "(from --upstream)")


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_sim_on_a_port_out_of_range_is_a_usage_error(port: str) -> None:
    """`kvgate sim --port 70000` ended in an OverflowError's traceback from bind()."""
    result = kvgate("sim", "--model", "m", f"--port={port}")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"kvgate sim: error: argument --port: '{port}': a port from 0 to 65535")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_admin_with_a_timeout_that_is_no_time_is_a_usage_error(timeout: str) -> None:
    """0 failed as a connection error ("is kvgate running there?"); -1, nan and inf ended in
    a traceback from the socket layer."""
    result = kvgate("admin", f"--timeout={timeout}", "--url", f"http://127.0.0.1:{free_port()}",
                    "audit")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"kvgate admin: error: argument --timeout: '{timeout}': expected a positive number of "
        "seconds")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("argv", "line"), [
    # a ZeroDivisionError's traceback
    (["replay", "--synthetic", "--offline", "--rate-scale", "0"],
     "kvgate replay: error: argument --rate-scale: '0': expected a number above 0"),
    # a table of nan
    (["replay", "--synthetic", "--offline", "--rate-scale", "nan"],
     "kvgate replay: error: argument --rate-scale: 'nan': expected a number above 0"),
    # routing.router.NoCandidate's traceback
    (["replay", "--synthetic", "--offline", "--replicas", "0"],
     "kvgate replay: error: argument --replicas: '0': expected a whole number above 0"),
    # the engine's ValueError's traceback
    (["replay", "--synthetic", "--offline", "--kv-tokens", "10"],
     "kvgate replay: --kv-tokens: at least 32 (two KV blocks of 16 tokens)"),
    # an IndexError's traceback
    (["replay", "--synthetic", "--offline", "--gateways", "2", "--sync-delay-ms", "nan"],
     "kvgate replay: error: argument --sync-delay-ms: 'nan': expected a number of 0 or more"),
    # a simulator started, with nan seconds per simulated second
    (["sim", "--model", "m", "--port", "0", "--time-scale", "nan"],
     "kvgate sim: time_scale must be a finite number > 0"),
    # a ZeroDivisionError's traceback
    (["sim", "--model", "m", "--port", "0", "--block-size", "0"],
     "kvgate sim: --block-size must be >= 1"),
    # accepted: every request over an SLO of 0 (or of nan) s, no tenant at all, a tier of nan
    (["replay", "--synthetic", "--offline", "--slo-ttft-s", "nan"],
     "kvgate replay: error: argument --slo-ttft-s: 'nan': expected a number above 0"),
    (["replay", "--synthetic", "--offline", "--tier-mix", "a:1", "--tenants", "0"],
     "kvgate replay: error: argument --tenants: '0': expected a whole number above 0"),
    (["replay", "--synthetic", "--offline", "--tier-mix", "a:nan"],
     "kvgate replay: --tier-mix: 'a:nan' is not TIER:SHARE with SHARE > 0"),
    # a simulator started that waited nan ms before each request
    (["sim", "--model", "m", "--port", "0", "--latency-ms", "nan"],
     "kvgate sim: latency_ms, latency_jitter_ms, max_num_queued_reqs, health_latency_ms and "
     "metrics_latency_ms must be finite, >= 0"),
])
def test_a_number_flag_out_of_range_is_one_line(argv: list[str], line: str) -> None:
    result = kvgate(*argv)
    assert result.returncode in (1, 2), result.stderr
    assert result.stderr.splitlines()[-1] == line
    assert "Traceback" not in result.stderr


def test_sim_with_no_kv_blocks_is_refused_not_given_the_presets() -> None:
    """`--num-gpu-blocks 0` was read as "not given": a simulator with the preset's cache."""
    result = kvgate("sim", "--model", "m", "--port", "0", "--num-gpu-blocks", "0")
    assert result.returncode == 2, result.stderr
    assert "raise --num-gpu-blocks" in result.stderr.splitlines()[-1]
