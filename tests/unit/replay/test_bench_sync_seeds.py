"""`python -m loadtest.bench_sync --offline --seeds ... --gateway-seeds ...`: N gateways against
one over workload and gateway seeds, each run a ratio to one gateway of its own workload seed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loadtest import bench_sync
from loadtest.bench_sync_seeds import Item, item, requests, seed_list
from loadtest.replay.cli import run_offline
from loadtest.replay.offline import FleetSpec, GatewaySpec

LIMIT = 150  # bursts' first 150 requests: a fraction of a second a replay


def _figures(seed: int, spec: GatewaySpec) -> tuple[float, float, float]:
    out = run_offline(requests("bursts", seed, None, LIMIT), FleetSpec(kv_tokens=262_144),
                      "cache_aware", 0.0, gateways=spec)
    return float(out["hit_rate"]), float(out["ttft_p50_s"]), float(out["ttft_p99_s"])  # type: ignore[arg-type]


def _shown(many: tuple[float, float, float], one: tuple[float, float, float]) -> list[str]:
    ratios = (many[0] / one[0], many[1] / one[1], many[2] / one[2])
    past = (ratios[0] < 0.97, ratios[1] > 1.05, ratios[2] > 1.05)
    return [f"**{x:.3f}**" if bad else f"{x:.3f}" for x, bad in zip(ratios, past, strict=True)]


def _rows(report: str, header: str) -> list[list[str]]:
    lines = report.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_two_gateways_over_two_seeds_against_one_gateway_of_the_same_seed(
        tmp_path: Path) -> None:
    argv = ["--offline", "-w", "bursts@262144:14-15", "--gateway-seeds", "0-1", "--gateways", "2",
            "--limit", str(LIMIT), "--out", str(tmp_path / "r")]
    assert bench_sync.main(argv) == 0
    report = (tmp_path / "r" / "bench_sync_seeds.md").read_text()
    assert "`python -m loadtest.bench_sync --offline -w bursts@262144:14-15 " in report
    rows = _rows(report, "| workload | workload seed | gateway seed |")
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("bursts", "14", "0"), ("bursts", "14", "1"), ("bursts", "15", "0"), ("bursts", "15", "1")]
    one = {seed: _figures(seed, GatewaySpec()) for seed in (14, 15)}
    assert one[14] != one[15]
    against_other_seed = []
    for r in rows:
        seed, gseed = int(r[1]), int(r[2])
        many = _figures(seed, GatewaySpec(2, True, 0.010, gseed))
        assert r[3:6] == _shown(many, one[seed])
        assert r[6] == f"{one[seed][0]:.4f} / {one[seed][1]:.3f} / {one[seed][2]:.3f}"
        misses = [k for k, x in zip(("hit", "p50", "p99"), r[3:6], strict=True) if "**" in x]
        assert r[7] == (f"miss: {', '.join(misses)}" if misses else "met")
        against_other_seed.append(r[3:6] != _shown(many, one[29 - seed]))
    assert all(against_other_seed)  # the base is its own seed's, which tells them apart
    assert {r[7] == "met" for r in rows} == {True, False}  # both kinds of cell marked
    means = _rows(report, "| workload | runs |")
    assert [m[:2] for m in means] == [["bursts", "4"]]


def test_items_and_seed_lists() -> None:
    assert seed_list("14-21") == tuple(range(14, 22))
    assert seed_list("0,2,5-6") == (0, 2, 5, 6)
    assert item("bursts") == Item("bursts")
    assert item("synthetic@262144:7-11:g0") == Item("synthetic", (262_144,), (7, 8, 9, 10, 11),
                                                   (0,))
    assert item("heavy-tail@262144,1048576:g0-2") == Item(
        "heavy-tail", (262_144, 1_048_576), None, (0, 1, 2))
    assert item("mooncake-1.5x@262144") == Item("mooncake-1.5x", (262_144,))
    for bad in ("no-such-workload", "bursts:1-x", "mooncake:3", "bursts:1:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            item(bad)


def test_seed_options_go_with_offline() -> None:
    with pytest.raises(SystemExit):
        bench_sync.main(["--cost", "--seeds", "14-21"])
