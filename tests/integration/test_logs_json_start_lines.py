"""With ``--log-format json`` every line `kvgate serve` and `kvgate epp` write is a JSON log
line: their start-up warnings too (the no-auth banner, the quick form's), which a log collector
parsing each stderr line as JSON otherwise met as bare text. Real gateway and picker, a
simulated replica."""

from __future__ import annotations

import json
from collections.abc import Callable

from tests.support.epp import epp_proc
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


def test_start_warnings_are_json_lines(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, _ = gateway_proc(upstreams=[sim], args=["--log-format", "json"],
                         env={"KVGATE_CONFIG": "unread-config.yaml"})
    with gw:  # started and ready: the start-up lines are written
        output = gw.output(None)
    _all_json_with_banners(output, "WITHOUT AUTHENTICATION", "--upstream is the quick form")


def test_start_warnings_are_said_whatever_the_log_level(sim_factory: SimFactory) -> None:
    """The banners were written whatever `--log-level` said, as bare text; as JSON log lines
    at level warning, `--log-level error` dropped them: a gateway serving without
    authentication started without a word of it."""
    _, sim = sim_factory("--time-scale", "50")
    gw, _ = gateway_proc(upstreams=[sim], args=["--log-format", "json", "--log-level", "error"])
    with gw:
        output = gw.output(None)
    lines = [json.loads(line) for line in output.splitlines() if line.strip()]
    warnings = [r["msg"] for r in lines if r["level"] == "warning"]
    assert any("WITHOUT AUTHENTICATION" in m for m in warnings), output


def test_the_pickers_start_warnings_are_json_lines(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    picker = epp_proc(upstreams=[sim], args=["--log-format", "json"])
    with picker:
        output = picker.output(None)
    _all_json_with_banners(output, "WITHOUT AUTHENTICATION")


def _all_json_with_banners(output: str, *banners: str) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    not_json = [line for line in lines if not line.startswith("{")]
    assert not not_json, not_json
    records = [json.loads(line) for line in lines]
    warnings = [r["msg"] for r in records if r["level"] == "warning"]
    for banner in banners:
        assert any(banner in m for m in warnings), (banner, warnings)
    assert any(r["msg"].startswith("listening on") for r in records)
