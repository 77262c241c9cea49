"""`python -m loadtest.apply_cost`: the batches one router applies are captured and applied
again in each tree named, each in its own process."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.procs import ROOT


def test_two_trees_apply_the_same_routes_side_by_side() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loadtest.apply_cost", "--requests", "400", "--rounds", "1",
         "--reps", "1", "--tree", str(ROOT), "--tree", str(ROOT)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rounds = re.findall(r"^round 0 .*: ([\d.]+) us per route applied \((\d+) routes\)$",
                        result.stdout, re.M)
    assert len(rounds) == 2, result.stdout
    assert rounds[0][1] == rounds[1][1] and int(rounds[0][1]) > 100  # the same capture
    assert all(float(us) > 0 for us, _ in rounds)
    assert re.search(r"^median .*\(1\.000x the first\)$", result.stdout, re.M), result.stdout
