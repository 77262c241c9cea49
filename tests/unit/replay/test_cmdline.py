"""A benchmark's printed command carries no path of the machine it ran on."""

from __future__ import annotations

from loadtest.cmdline import shown_command


def test_paths_are_cut_to_their_file_name() -> None:
    argv = ["--offline", "--trace", "/srv/data/traces/conv.jsonl", "--jobs", "1", "out/"]
    shown = shown_command("loadtest.bench_sync", argv)
    assert shown == "python -m loadtest.bench_sync --offline --trace <conv.jsonl> --jobs 1 <out>"
    assert "/" not in shown


def test_plain_arguments_are_kept() -> None:
    assert shown_command("loadtest.bench_doctor", ["--runs", "3"]) == (
        "python -m loadtest.bench_doctor --runs 3"
    )


def test_flag_values_and_urls() -> None:
    shown = shown_command("m", ["--out=/srv/r/x.json", "--target", "http://127.0.0.1:8000/v1"])
    assert shown == "python -m m --out=<x.json> --target http://127.0.0.1:8000/v1"
