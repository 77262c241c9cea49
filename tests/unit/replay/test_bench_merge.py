"""bench_replay --merge: a partial re-run keeps the load-factor sweep and several-gateways
tables of the workloads it did not run, and replaces those of the workloads it did."""

from __future__ import annotations

from loadtest.bench_replay import markdown, merged

SWEEP_TITLE = "## cache_aware: bounded-load factor c"
GATEWAYS_TITLE = "## Several gateways"


def _row(scenario: str, policy: str, hit: float, **extra: object) -> dict[str, object]:
    return {"scenario": scenario, "policy": policy, "hit_rate": hit,
            "hit_rate_vs_reference": 0.5, "ttft_p50_s": 0.2, "ttft_p99_s": 1.0,
            "e2e_p99_s": 2.0, "max_over_mean_inflight": 1.1, "preemptions": 0, **extra}


def _sweep(hit: float) -> list[dict[str, object]]:
    return [_row("mooncake-1x", "cache_aware", hit,
                 load_bound={"factor": c, "slack": 4.0, "violations": 0})
            for c in (1.25, 2.0, 4.0)]


def _previous() -> dict[str, object]:
    """A hand-made earlier routing.json: three workloads, the sweep, two gateway rows."""
    names = ("mooncake-1x", "synthetic", "hot-prefixes-256k")
    return {
        "scenarios": {n: [_row(n, "cache_aware", 0.1), _row(n, "oracle", 0.2)] for n in names},
        "load_factor_sweep": _sweep(0.1),
        "gateways": [_row("mooncake-1x", "cache_aware", 0.09),
                     _row("synthetic", "cache_aware", 0.08)],
        "targets": {},
    }


def test_a_rerun_without_mooncake_or_synthetic_keeps_both_tables() -> None:
    # `--only hot-prefixes-256k --policies cache_aware`: no sweep, no gateway rows computed
    new: dict[str, object] = {
        "scenarios": {"hot-prefixes-256k": [_row("hot-prefixes-256k", "cache_aware", 0.3)]},
        "load_factor_sweep": [], "gateways": []}
    prev = _previous()
    out = merged(prev, new, {"cache_aware"})
    assert out["load_factor_sweep"] == prev["load_factor_sweep"]
    assert out["gateways"] == prev["gateways"]
    report = markdown(out)
    assert SWEEP_TITLE in report and GATEWAYS_TITLE in report
    assert "| synthetic | 1 |" in report and "| mooncake-1x | 1 |" in report


def test_a_rerun_of_mooncake_replaces_its_rows_and_keeps_synthetics() -> None:
    new: dict[str, object] = {
        "scenarios": {"mooncake-1x": [_row("mooncake-1x", "cache_aware", 0.3)]},
        "load_factor_sweep": _sweep(0.3),
        "gateways": [_row("mooncake-1x", "cache_aware", 0.29)]}
    out = merged(_previous(), new, {"cache_aware"})
    assert out["load_factor_sweep"] == _sweep(0.3)
    assert out["gateways"] == [_row("mooncake-1x", "cache_aware", 0.29),  # the workloads' order
                               _row("synthetic", "cache_aware", 0.08)]
    assert SWEEP_TITLE in markdown(out)


def test_a_rerun_of_other_policies_keeps_both_tables_as_they_were() -> None:
    new: dict[str, object] = {
        "scenarios": {"mooncake-1x": [_row("mooncake-1x", "oracle", 0.4)]},
        "load_factor_sweep": [], "gateways": []}
    prev = _previous()
    out = merged(prev, new, {"oracle"})
    assert out["load_factor_sweep"] == prev["load_factor_sweep"]
    assert out["gateways"] == prev["gateways"]
