"""`kvgate replay` given what cannot be replayed: one line and exit status 2, before anything
runs (exit status 1 is kept for a replay whose requests failed, or a target that failed).

An unknown policy was told only after the whole trace was read (exit 1), an unwritable --json
only after the whole replay had run (an hour of a large trace, then nothing written), and a
TRACE given with --synthetic was silently not replayed."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main as kvgate

TRACE = ('{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}\n'
         '{"timestamp": 10, "input_length": 1024, "output_length": 4, "hash_ids": [1, 3]}\n')


def _usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = kvgate(["replay", *argv])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and not captured.out, captured
    assert len(err) == 1 and err[0].startswith("kvgate replay: "), err  # no progress: nothing ran
    return err[0]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text(TRACE)
    return path


def test_an_unknown_policy_is_a_usage_error(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _usage_error(capsys, str(trace), "--offline", "--policy", "nonsense")
    assert "unknown policy 'nonsense' (known: round_robin, " in line
    line = _usage_error(capsys, str(trace), "--target", "http://127.0.0.1:9", "--policy", "oracle")
    assert "'oracle' (a yardstick: offline only)" in line


@pytest.mark.parametrize("where", ["missing/s.json", "t.jsonl/s.json"])
def test_an_unwritable_json_is_told_before_the_replay(
    where: str, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = trace.parent / where
    line = _usage_error(capsys, str(trace), "--offline", "--policy", "all", "--json", str(out))
    assert line.startswith(f"kvgate replay: --json {out}: "), line
    assert not out.exists()


def test_json_is_tried_without_leaving_a_file(trace: Path) -> None:
    """The early try removes the file it made when the replay then stops on the trace."""
    out = trace.parent / "s.json"
    trace.write_text(TRACE + "not json\n")
    assert kvgate(["replay", str(trace), "--offline", "--json", str(out)]) == 2
    assert not out.exists()
    trace.write_text(TRACE)
    assert kvgate(["replay", str(trace), "--offline", "--json", str(out)]) == 0
    assert out.read_bytes().startswith(b"[")


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_a_trace_that_is_not_a_file_is_a_usage_error(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "no.jsonl" if kind == "missing" else tmp_path
    line = _usage_error(capsys, str(path), "--offline")
    why = "No such file or directory" if kind == "missing" else "Is a directory"
    assert line == f"kvgate replay: cannot read the trace {path}: {why}"


def test_a_bad_line_is_a_usage_error(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace.write_text(TRACE + '{"timestamp": 20, "input_length": -1}\n')
    assert "line 3: no output_length, hash_ids" in _usage_error(capsys, str(trace), "--offline")


@pytest.mark.parametrize(("argv", "says"), [
    (["--synthetic"], "give one workload: a TRACE file, --synthetic or --workload NAME"),
    (["--workload", "bursts"], "give one workload"),
    (["--kv-tokens", "16"], "--kv-tokens: at least 32 (two KV blocks of 16 tokens)"),
    (["--tier-mix", "a:0"], "--tier-mix: 'a:0' is not TIER:SHARE with SHARE > 0"),
])
def test_flags_that_cannot_replay(
    argv: list[str], says: str, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in _usage_error(capsys, str(trace), "--offline", *argv)


def test_nothing_to_replay_and_no_mode_are_usage_errors(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "give one workload" in _usage_error(capsys, "--offline")
    assert "live mode needs --target URL or --spawn" in _usage_error(capsys, str(trace))


def test_several_gateways_live_is_a_usage_error(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--gateways 3 with --spawn replayed through one gateway and said nothing."""
    line = _usage_error(capsys, str(trace), "--spawn", "--gateways", "3")
    assert line.startswith("kvgate replay: --gateways: offline only")
