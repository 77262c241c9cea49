"""Progress of the offline replay: `replay_offline` reports each routed request to its
`progress` callback, and `kvgate replay --offline` shows it per policy (a bar on a terminal,
a line per 10 % otherwise)."""

from __future__ import annotations

import io
import re

import pytest

from gateway.cli import main as kvgate
from loadtest.replay.offline import FleetSpec, replay_offline
from loadtest.replay.workload import synthetic_multitenant
from routing.router import RouterConfig


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_replay_offline_reports_every_routed_request() -> None:
    reqs = synthetic_multitenant()[:40]
    steps: list[int] = []
    result = replay_offline(reqs, FleetSpec(replicas=2), RouterConfig(), progress=steps.append)
    assert steps == [1] * 40
    assert len(result.outcomes) == 40


def test_offline_cli_prints_progress_lines_per_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = kvgate(["replay", "--synthetic", "--offline", "--replicas", "2", "--limit", "50",
                   "--policy", "all"])
    assert code == 0
    err = capsys.readouterr().err
    for policy in ("cache_aware", "round_robin"):
        lines = [ln for ln in err.splitlines() if ln.startswith(f"policy {policy}: ")]
        counts = [ln.split(": ")[1] for ln in lines if ln.endswith(" requests")]
        # the first request, then every 10 %
        assert counts == [f"{n}/50 requests" for n in (1, *range(5, 51, 5))], lines
        assert lines[-1].startswith(f"policy {policy}: done in ")


def test_offline_cli_draws_a_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert kvgate(["replay", "--synthetic", "--offline", "--replicas", "2", "--limit", "30",
                   "--policy", "round_robin"]) == 0
    out = term.getvalue()
    frames = re.findall(r"\rpolicy round_robin \[([#.]{30})\] (\d+)/30", out)
    assert frames and frames[-1] == ("#" * 30, "30")
    assert [int(n) for _, n in frames] == sorted(int(n) for _, n in frames)  # it advances
    assert len(frames) > 5
