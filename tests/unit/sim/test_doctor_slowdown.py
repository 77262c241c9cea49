"""`kvgate sim --slowdown F`: the engine a doctor scenario needs 2x slower than its peers (a
slower GPU) takes every step F times as long; a factor that is not a positive number is
refused as the other flags' bad values are."""

from __future__ import annotations

import pytest

from loadtest.sim.cli import build_app, parser


def _cost(*flags: str) -> tuple[float, float, float, float]:
    c = build_app(parser().parse_args(["--model", "m", *flags])).engine.config.cost
    return c.step_overhead_s, c.prefill_token_s, c.decode_seq_s, c.kv_read_token_s


def test_slowdown_scales_every_term_of_a_step() -> None:
    base, slow = _cost(), _cost("--slowdown", "2")
    assert slow == tuple(2 * v for v in base)
    assert _cost("--slowdown", "1") == base


@pytest.mark.parametrize("factor", ["0", "-1", "nan", "inf"])
def test_a_slowdown_that_is_not_a_positive_number_is_refused(factor: str) -> None:
    with pytest.raises(ValueError, match="--slowdown"):
        _cost("--slowdown", factor)
