"""`BlindWatch` waits at least `BLIND_MARGIN` x the longest first-event wait served there."""

from __future__ import annotations

from gateway.stall import BLIND_MARGIN, BlindWatch


def test_a_served_wait_raises_the_silence_judged_a_stall() -> None:
    watch = BlindWatch(2.0)
    assert not watch.observe(5, True, 0.0, longest_first_s=3.0)
    assert not watch.observe(5, True, 2.5, longest_first_s=3.0)  # past after_s: not yet
    assert not watch.observe(5, True, BLIND_MARGIN * 3.0 - 0.1, longest_first_s=3.0)
    assert watch.observe(5, True, BLIND_MARGIN * 3.0, longest_first_s=3.0)


def test_without_history_after_s_alone_judges() -> None:
    watch = BlindWatch(2.0)
    assert not watch.observe(1, True, 0.0)
    assert watch.observe(1, True, 2.0)
