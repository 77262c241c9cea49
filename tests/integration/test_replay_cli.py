"""`kvgate replay` as a user runs it: the documented commands and trace path, failures that show
(table, reasons, exit status), one-line errors instead of tracebacks, progress, and where a
bare `--json` writes."""

from __future__ import annotations

import gzip
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import orjson

from loadtest.replay.report import COLUMNS, ORACLE_COLUMNS
from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import KVGATE, ROOT, Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
SAMPLE = "loadtest/data/mooncake_sample.jsonl"
ADMIN = "admin-token-0123456789abcdef"
DOC = "docs/routing-and-replay.md"  # where the user documentation of `kvgate replay` lives


def replay(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVGATE, "replay", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def one_line_error(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """1: the replay failed as it ran; 2: what it was given cannot be replayed."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgate replay: "), result.stderr
    return lines[0]


def test_documented_replay_commands_use_a_trace_that_exists() -> None:
    doc = (ROOT / DOC).read_text()
    traces = re.findall(r"^kvgate replay (\S+\.jsonl)", doc, re.M)
    assert traces, f"{DOC} shows `kvgate replay TRACE ...`"
    for trace in traces:
        assert (ROOT / trace).is_file(), trace


def test_the_table_has_the_documented_columns() -> None:
    doc = (ROOT / DOC).read_text()
    described = re.search(r"a table with the columns (.*?)`--json", doc, re.S)
    assert described, f"{DOC} describes the replay table's columns"
    assert tuple(re.findall(r"`([^`]+)`", described.group(1))) == COLUMNS + ORACLE_COLUMNS


def test_offline_replay_of_the_sample_table_and_bare_json(tmp_path: Path) -> None:
    """A bare `--json` writes in the working directory (it wrote into the source tree's
    loadtest/results/ whatever the working directory: site-packages for an installed kvgate)."""
    results = ROOT / "loadtest" / "results"
    before = set(results.glob("replay-*.json"))
    result = replay(str(ROOT / SAMPLE), "--offline", "--replicas", "4", "--policy", "all",
                    "--limit", "120", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0].split()
    assert tuple(header) == COLUMNS + ORACLE_COLUMNS  # `all` offline: the oracle ran
    # one row per policy: the registry's 4, the peers' 2 rules and the oracle
    assert len(result.stdout.splitlines()) == 1 + 7
    assert "policy cache_aware: done" in result.stderr  # progress, one line per phase
    assert "policy round_robin: 120/120 requests" in result.stderr  # and per 10 %
    assert set(results.glob("replay-*.json")) == before  # nothing in the source tree
    (written,) = tmp_path.glob("replay-*.json")
    assert f"summaries written to {written.name}" in result.stderr
    summaries = orjson.loads(written.read_bytes())
    assert [s["requests"] for s in summaries] == [120] * 7


def test_json_into_a_directory_or_nowhere(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = (str(ROOT / SAMPLE), "--offline", "--replicas", "2", "--limit", "20")
    assert replay(*args, "--json", str(out), cwd=tmp_path).returncode == 0
    assert len(list(out.glob("replay-*.json"))) == 1  # a timestamped file in DIR
    nowhere = replay(*args, "--json", str(tmp_path / "no" / "s.json"))
    # told before the replay runs, not after it
    last = one_line_error(nowhere, 2)
    assert last.startswith("kvgate replay: --json ") and "No such file" in last, last


def test_missing_trace_is_one_line() -> None:
    line = one_line_error(replay("no/such/trace.jsonl", "--offline"), 2)
    assert "no/such/trace.jsonl" in line and "No such file" in line


def test_unreachable_replica_is_one_line(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    dead = f"http://127.0.0.1:{free_port()}"
    with gw:
        line = one_line_error(replay(SAMPLE, "--limit", "3", "--target", base,
                                     "--replica", dead, "--time-scale", "50"))
    assert dead in line and "unreachable" in line


def test_auth_on_gateway_without_api_key_fails_visibly(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], auth=True,
                            env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with gw:
        result = replay(SAMPLE, "--limit", "5", "--target", base, "--replica", sim,
                        "--time-scale", "50")
        # /v1/models needs a key too: the replay stops before sending anything, in one line
        assert result.returncode == 1 and not result.stdout
        assert "GET /v1/models answered 401 (give --api-key)" in result.stderr
        assert "Traceback" not in result.stderr
        # and with a key, the same command succeeds
        with admin_client(base, ADMIN) as admin:
            admin.post("/tenants", json={"id": "bench", "tier": "default"})
            key = admin.post("/tenants/bench/keys").json()["key"]
        ok = replay(SAMPLE, "--limit", "5", "--target", base, "--api-key", key,
                    "--replica", sim, "--time-scale", "50")
        assert ok.returncode == 0, ok.stderr
        row = dict(zip(COLUMNS, ok.stdout.splitlines()[1].split(), strict=True))
        assert row["failed"] == "0", shlex.join(ok.args)


def test_a_gzipped_trace_in_epoch_milliseconds_replays_live(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    """A trace with epoch timestamps made a live replay sleep until the first one (55 years:
    the run hung); gzip was refused. Arrivals now count from the first request."""
    rows = [{"timestamp": 1_700_000_000_000 + 50 * i, "input_length": 600 + i,
             "output_length": 4, "hash_ids": [1, 2 + i]} for i in range(3)]
    trace = tmp_path / "epoch.jsonl.gz"
    trace.write_bytes(gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in rows)))
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        result = replay(str(trace), "--target", base, "--replica", sim, "--time-scale", "50",
                        "--json", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr
    (summary,) = orjson.loads((tmp_path / "s.json").read_bytes())
    assert (summary["requests"], summary["failed"]) == (3, 0)


def test_a_target_without_replicas_reports_no_hit_rate(sim_factory: SimFactory) -> None:
    """Without --replica no replica's counters are read: the hit rate is `n/a`, not a
    measured-looking 0.0; the row is the target's (it routes with its own policy, whatever
    --policy says), once, even with --policy all."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        result = replay(SAMPLE, "--limit", "3", "--target", base, "--time-scale", "50",
                        "--policy", "all")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    row = dict(zip(COLUMNS, lines[1].split(), strict=True))
    assert (row["policy"], row["hit_rate"], row["failed"]) == ("target", "n/a", "0"), row
