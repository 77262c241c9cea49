"""`kvgate replay` on a user's trace: a result that means what it says, or one clear line.

Each trace here is written the way users' tools write them (gzip, a byte order mark, CRLF,
unsorted lines, epoch timestamps, unsigned 64-bit ids) or wrongly (strings, floats, negative
lengths, a missing field); the replay either agrees with the plain file's replay or stops with
the line and the field named, exit status 2 (what was given cannot be replayed) and no
traceback.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from gateway.cli import main as kvgate
from loadtest.replay.trace import MAX_TOKENS
from loadtest.replay.workload import load_mooncake

Row = dict[str, object]


def _row(ts: float, tokens: object, ids: Sequence[object], out: int = 8) -> Row:
    return {"timestamp": ts, "input_length": tokens, "output_length": out, "hash_ids": ids}


# a shared first block, a conversation growing turn by turn, a stranger: something to cache
SPECS = [(0, 1024, [7, 1]), (400, 1500, [7, 1, 2]), (800, 600, [9, 3]), (1200, 2000, [7, 1, 2, 4])]
ROWS = [_row(*spec) for spec in SPECS]


def _write(path: Path, rows: list[Row], *, nl: str = "\n", head: bytes = b"") -> Path:
    path.write_bytes(head + "".join(json.dumps(r) + nl for r in rows).encode())
    return path


def _replay(trace: Path, out: Path, *extra: str) -> tuple[int, list[dict[str, object]]]:
    code = kvgate(["replay", str(trace), "--offline", "--replicas", "2", "--kv-tokens", "65536",
                   *extra, "--json", str(out)])
    summaries = json.loads(out.read_text()) if out.exists() else []
    return code, summaries


def _one_line_error(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code, summaries = _replay(trace, tmp_path / "never.json")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not summaries
    assert len(err) == 1 and err[0].startswith("kvgate replay: "), err
    return err[0]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (_row(900, 1024, ["a", "b"]), 'line 5: hash_ids holds "a"'),  # was struct.error
        (_row(900, 1024, [3.0, 4]), "line 5: hash_ids holds 3.0"),
        (_row(900, 1024, [2**70]), "line 5: hash_ids holds 1.18"),  # orjson: a float
        (_row(900, -5, [3]), "line 5: input_length -5 is not a whole number"),  # replayed
        (_row(900, 0, []), "line 5: input_length 0 is not"),
        (_row(900, 100.5, [3]), "line 5: input_length 100.5 is not"),  # was cut to 100
        (_row(900, True, [3]), "line 5: input_length true is not"),  # was 1 token
        (_row(900, 100, [3], out=-3), "line 5: output_length -3 is not"),  # was 1 token
        (_row(900, MAX_TOKENS + 1, [3]), f"line 5: input_length {MAX_TOKENS + 1} is not"),
        ({"timestamp": "900", "input_length": 10, "output_length": 1, "hash_ids": [1]},
         'line 5: timestamp "900" is not a finite number'),
        ({"timestamp": 900, "input_length": 10, "output_length": 1},
         "line 5: no hash_ids"),  # was "KeyError: 'hash_ids'", no line
        ({"timestamp": 900, "input_length": 10, "output_length": 1, "hash_ids": None},
         "line 5: hash_ids null is not a list"),
        ([1, 2, 3], "line 5: [1,2,3] is not a JSON object"),
    ],
)
def test_a_bad_line_is_named(
    line: object, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS, line]))
    assert f"the trace {trace}: {says}" in _one_line_error(trace, tmp_path, capsys)


def test_a_cut_line_and_an_empty_trace_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cut = _write(tmp_path / "cut.jsonl", ROWS)
    cut.write_bytes(cut.read_bytes() + b'{"timestamp": 1600, "input_len')
    assert "line 5: not JSON (" in _one_line_error(cut, tmp_path, capsys)
    for text in ("", "\n\n  \n"):  # replayed as 0 requests, exit status 0
        empty = tmp_path / "empty.jsonl"
        empty.write_text(text)
        assert "no request in it" in _one_line_error(empty, tmp_path, capsys)


def test_gzip_bom_crlf_blank_lines_replay_as_the_plain_file(tmp_path: Path) -> None:
    """A gzipped trace, a UTF-8 byte order mark, CRLF ends and blank lines were refused or
    misread; each now replays exactly as the plain file."""
    plain = _write(tmp_path / "plain.jsonl", ROWS)
    code, expected = _replay(plain, tmp_path / "plain.json")
    assert code == 0 and expected[0]["requests"] == len(ROWS)
    zipped = tmp_path / "trace.jsonl.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    variants = [zipped, _write(tmp_path / "bom.jsonl", ROWS, head=b"\xef\xbb\xbf"),
                _write(tmp_path / "crlf.jsonl", ROWS, nl="\r\n\r\n")]
    for i, trace in enumerate(variants):
        assert _replay(trace, tmp_path / f"v{i}.json") == (0, expected), trace.name


def test_unsigned_64_bit_ids_replay_as_their_signed_twins(tmp_path: Path) -> None:
    """Ids of 2**63 and above (unsigned 64-bit hashes) ended in a traceback; each is read as
    the signed 64-bit integer of the same bits."""
    def shifted(by: int) -> list[Row]:
        return [_row(ts, n, [i + by for i in ids]) for ts, n, ids in SPECS]

    code, unsigned = _replay(_write(tmp_path / "u64.jsonl", shifted(2**63)), tmp_path / "a.json")
    assert code == 0 and unsigned[0]["failed"] == 0
    assert _replay(_write(tmp_path / "i64.jsonl", shifted(-(2**63))), tmp_path / "b.json") == (
        0, unsigned)


def test_unsorted_lines_replay_in_time_order(tmp_path: Path) -> None:
    """The pooled reference took an unsorted trace's lines in file order while the replay took
    them in time order: here A, its repeat A' and then B, which evicts A from a fleet that holds
    8 trace blocks. In file order (A, B, A') the reference saw no hit at all."""
    a, b = _row(0, 1024, [1, 2]), _row(2000, 3584, [3, 4, 5, 6, 7, 8, 9])
    again = _row(1000, 1024, [1, 2])
    args = ("--replicas", "1", "--kv-tokens", "4096")
    code, ordered = _replay(_write(tmp_path / "s.jsonl", [a, again, b]), tmp_path / "s.json",
                            *args)
    assert code == 0 and float(str(ordered[0]["pooled_reference_hit_rate"])) > 0.1
    assert _replay(_write(tmp_path / "u.jsonl", [a, b, again]), tmp_path / "u.json",
                   *args) == (0, ordered)


def test_equal_timestamps_keep_the_file_order(tmp_path: Path) -> None:
    rows = [_row(5, 600 + i, [i]) for i in range(4)]
    assert [r.prompt_tokens for r in load_mooncake(_write(tmp_path / "t.jsonl", rows))] == [
        600, 601, 602, 603]


def test_arrivals_count_from_the_first_request(tmp_path: Path) -> None:
    """Epoch timestamps: a live replay slept until the timestamp (55 years)."""
    epoch = [_row(1_700_000_000_000 + ts, n, ids) for ts, n, ids in SPECS]
    reqs = load_mooncake(_write(tmp_path / "e.jsonl", epoch), rate_scale=2.0)
    assert [r.arrival_s for r in reqs] == [0.0, 0.2, 0.4, 0.6]
    code, got = _replay(tmp_path / "e.jsonl", tmp_path / "e.json")
    assert code == 0
    assert _replay(_write(tmp_path / "z.jsonl", ROWS), tmp_path / "z.json") == (0, got)


def test_arrivals_years_apart_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Microseconds read as milliseconds: offline, a TTFT of float noise; live, a wait of
    years."""
    rows = [*ROWS, _row(2**62, 600, [9, 3])]
    line = _one_line_error(_write(tmp_path / "t.jsonl", rows), tmp_path, capsys)
    assert "the arrivals span 1.46e+08 years" in line and "--rate-scale 1000" in line


def test_a_trace_in_seconds_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [_row(t / 10, 1024, [t, t + 1]) for t in range(100)]  # 10 s, written in seconds
    code, summaries = _replay(_write(tmp_path / "s.jsonl", rows), tmp_path / "s.json")
    err = capsys.readouterr().err
    assert code == 0 and summaries[0]["requests"] == 100
    assert ("kvgate replay: warning: the trace's 100 requests arrive within 0.0099 s" in err
            and "--rate-scale 0.001 reads them so" in err), err
    _replay(_write(tmp_path / "ms.jsonl", ROWS), tmp_path / "ms.json")
    assert "warning" not in capsys.readouterr().err
    # read as seconds, as the warning says: no warning (it said to do what was done)
    _replay(tmp_path / "s.jsonl", tmp_path / "s2.json", "--rate-scale", "0.001")
    assert "warning" not in capsys.readouterr().err


def test_prompts_over_the_context_fail_with_a_reason_and_leave_the_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt no replica takes failed as "1 x failed", and still counted in the pooled
    reference (0.33 -> 0.005 here) beside a hit rate that never saw it."""
    code, within = _replay(_write(tmp_path / "ok.jsonl", ROWS), tmp_path / "ok.json")
    assert code == 0
    rows = [*ROWS, _row(1300, 200_000, list(range(100, 491)))]
    code, over = _replay(_write(tmp_path / "long.jsonl", rows), tmp_path / "long.json")
    (s,) = over
    reason = "HTTP 400: prompt + output over max_model_len 65520"
    assert code == 1 and s["failed"] == 1 and s["errors"] == {reason: 1}
    assert f"1 of 5 requests failed: 1 x {reason}" in capsys.readouterr().err
    assert s["pooled_reference_hit_rate"] == within[0]["pooled_reference_hit_rate"]
    assert s["hit_rate"] == within[0]["hit_rate"]


def test_a_messy_trace_replays_the_same_twice_and_adds_up(tmp_path: Path) -> None:
    """Every policy, two gateways: byte-identical JSON from two runs, counts that add up,
    rates in [0, 1] and no NaN."""
    rows = [*ROWS, _row(1200, 700, [7, 1], out=0), _row(1200, 9000, [2**64 - 1, 5]), ROWS[0]]
    trace = _write(tmp_path / "m.jsonl", rows[::-1], nl="\r\n", head=b"\xef\xbb\xbf")
    args = ("--policy", "all", "--gateways", "2")
    for run in ("1", "2"):
        assert kvgate(["replay", str(trace), "--offline", *args,
                       "--json", str(tmp_path / f"{run}.json")]) == 0
    first = (tmp_path / "1.json").read_bytes()
    assert first == (tmp_path / "2.json").read_bytes()
    assert b"NaN" not in first and b"Infinity" not in first
    for s in json.loads(first):
        assert s["requests"] == len(rows) == sum(s["requests_per_replica"].values())
        assert s["failed"] == sum(s["errors"].values()) == 0
        assert 0.0 <= s["hit_rate"] <= 1.0 and 0.0 <= s["pooled_reference_hit_rate"] <= 1.0
