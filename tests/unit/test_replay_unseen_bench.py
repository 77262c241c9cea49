"""`loadtest.bench_replay_unseen`'s replays: several gateways only for cache_aware, spread
over the gateway seeds asked for."""

from __future__ import annotations

from loadtest.bench_replay_unseen import GATEWAYS, tasks


def test_several_gateways_rows_are_cache_aware_over_each_seed_and_spread() -> None:
    todo = tasks(["tool-agent-256k"], 2, ("least_load", "cache_aware"), gateway_seeds=3)
    one = [t for t in todo if t[5] == 1]
    several = [t for t in todo if t[5] > 1]
    assert {(t[3], t[4]) for t in one} == {(s, p) for s in (51, 52)
                                          for p in ("least_load", "cache_aware")}
    assert {t[4] for t in several} == {"cache_aware"} and {t[5] for t in several} == {GATEWAYS}
    assert sorted((t[3], t[6]) for t in several) == [(s, g) for s in (51, 52) for g in range(3)]
    assert all(t[0] == "tool-agent-256k" and t[2] == 262_144 for t in todo)
    assert not [t for t in tasks(None, 1, ("least_load",), 2) if t[5] > 1]
