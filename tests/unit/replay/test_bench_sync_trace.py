"""`python -m loadtest.bench_sync --trace PATH` with a trace it cannot read stops at once with a
usage error naming the trace: a missing file left the conversation rows out without a word,
a bad line was a traceback minutes into the run."""
from pathlib import Path

import pytest

from loadtest import bench_sync


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as ended:
        bench_sync.main(argv)
    assert ended.value.code == 2
    return capsys.readouterr().err


def test_a_missing_trace_is_a_usage_error(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    err = _refused(["--offline", "--quick", "--trace", str(missing), "--out", str(tmp_path)],
                   capsys)
    assert f"--trace {missing}" in err and "No such file" in err
    assert not list(tmp_path.iterdir())  # no report written


def test_a_bad_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 512, "output_length": 4, '
                   '"hash_ids": [1]}\n{"timestamp": 1, "input_length": "many"}\n')
    err = _refused(["--offline", "--trace", str(bad), "--out", str(tmp_path / "r")], capsys)
    assert "line 2" in err and "Traceback" not in err


def test_an_empty_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "no request" in _refused(["--offline", "--trace", str(empty)], capsys)
