"""A trace as other tools write it: NaN from Python's json module, bzip2 and xz archives, a
pipe, UTF-16 text or a zstd archive (refused, saying what the file is).

orjson refuses NaN and Infinity, so a line with a NaN anywhere (even in a field the replay
ignores) was "not JSON (unexpected character ...)", the field unnamed; a bzip2 or xz trace, a
UTF-16 file and a zstd archive were all "line 1: not JSON"; a pipe failed on a seek."""

from __future__ import annotations

import bz2
import json
import lzma
import os
import threading
from pathlib import Path

import pytest

from gateway.cli import main as kvgate
from loadtest.replay.trace import TraceError, read_rows
from loadtest.replay.workload import load_mooncake

LINES = [
    '{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}',
    '{"timestamp": 10, "input_length": 1024, "output_length": 4, "hash_ids": [1, 3]}',
]
TEXT = "".join(f"{line}\n" for line in LINES)


def _write(tmp_path: Path, data: bytes, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_nan_in_an_ignored_field_is_ignored(tmp_path: Path) -> None:
    row = {"timestamp": 20, "input_length": 600, "output_length": 4, "hash_ids": [1],
           "score": float("nan"), "cost": float("inf")}
    trace = _write(tmp_path, (TEXT + json.dumps(row) + "\n").encode())
    assert [r.prompt_tokens for r in load_mooncake(trace)] == [1024, 1024, 600]


@pytest.mark.parametrize(("field", "value", "says"), [
    ("timestamp", float("nan"), "line 3: timestamp NaN is not a finite number"),
    ("timestamp", float("-inf"), "line 3: timestamp -Infinity is not a finite number"),
    ("timestamp", 10**400, "line 3: timestamp 1000000000000000000000000000000000000..."),
    ("input_length", float("nan"), "line 3: input_length NaN is not a whole number"),
    ("hash_ids", [1, float("inf")], "line 3: hash_ids holds Infinity: block ids are integers"),
], ids=["nan", "-inf", "400-digits", "length-nan", "id-inf"])
def test_nan_in_a_request_field_is_named(
    field: str, value: object, says: str, tmp_path: Path
) -> None:
    row = {"timestamp": 20, "input_length": 600, "output_length": 4, "hash_ids": [1]}
    row[field] = value
    trace = _write(tmp_path, (TEXT + json.dumps(row) + "\n").encode())
    with pytest.raises(TraceError) as caught:
        read_rows(trace)
    assert str(caught.value).startswith(says), caught.value


@pytest.mark.parametrize("pack", [bz2.compress, lzma.compress], ids=["bzip2", "xz"])
def test_bzip2_and_xz_read_as_the_plain_file(pack: object, tmp_path: Path) -> None:
    assert callable(pack)
    plain = load_mooncake(_write(tmp_path, TEXT.encode()))
    assert load_mooncake(_write(tmp_path, pack(TEXT.encode()), "t.jsonl.z")) == plain
    cut = pack(TEXT.encode())
    with pytest.raises(TraceError, match="the compressed data is damaged or cut short"):
        read_rows(_write(tmp_path, cut[: len(cut) // 2], "cut.z"))


@pytest.mark.parametrize(("data", "says"), [
    (TEXT.encode("utf-16"), "line 1: the file is UTF-16 text: save it as UTF-8"),
    (b"\x28\xb5\x2f\xfd" + bytes(16), "line 1: the file is zstd-compressed: decompress it"),
], ids=["utf-16", "zstd"])
def test_an_encoding_it_cannot_read_is_named(
    data: bytes, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write(tmp_path, data)
    assert kvgate(["replay", str(trace), "--offline"]) == 2
    assert capsys.readouterr().err.strip() == f"kvgate replay: the trace {trace}: {says}" + (
        " (gzip, bzip2 and xz are read as is)" if "zstd" in says else "")


def test_a_trace_from_a_pipe(tmp_path: Path) -> None:
    """`kvgate replay <(zcat trace.jsonl.gz)`: the gzip test's seek failed on a pipe."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "wb") as f:
            f.write(TEXT.encode())

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        got = load_mooncake(fifo)
    finally:
        writer.join(timeout=30)
    assert got == load_mooncake(_write(tmp_path, TEXT.encode()))


def test_a_trace_in_microseconds_is_warned_about(tmp_path: Path) -> None:
    """Ten minutes in microseconds at 5 requests a second: read as milliseconds, 6.9 days at
    one request every 200 s, which the warning (under one an hour on average) let pass."""
    rows = [{"timestamp": 1_700_000_000_000_000 + 200_000 * i, "input_length": 600,
             "output_length": 4, "hash_ids": [1, 2 + i]} for i in range(3000)]
    trace = _write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    notes: list[str] = []
    load_mooncake(trace, notes=notes)
    assert notes == ["the trace's 3000 requests span 6.94 days (timestamps are milliseconds; "
                     "if they are microseconds, --rate-scale 1000 reads them so)"]
    notes.clear()
    load_mooncake(trace, notes=notes, rate_scale=1000)
    assert notes == []


def test_a_trace_in_nanoseconds_is_refused_with_the_scale_that_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An hour in nanoseconds reads as 114 years: the refusal named only microseconds' scale
    (which then read 41 days, with a warning naming it again)."""
    rows = [{"timestamp": 1_700_000_000_000_000_000 + 360_000_000_000 * i, "input_length": 600,
             "output_length": 4, "hash_ids": [1, 2 + i]} for i in range(11)]
    trace = _write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    assert kvgate(["replay", str(trace), "--offline"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvgate replay: the trace {trace}: the arrivals span 114 years at --rate-scale 1: a "
        f"trace's timestamps are milliseconds (--rate-scale 1000 reads microseconds, 1000000 "
        f"nanoseconds)")
    assert kvgate(["replay", str(trace), "--offline", "--rate-scale", "1000000"]) == 0
    assert "warning" not in capsys.readouterr().err
