"""How long an engine has been hung, read from the window's ticks: timed between the scrapes'
own times, with its requests running or only waiting. `test_doctor_hung` failed on a loaded
host: the engine hung before scheduling its requests (all 6 waiting, none running), which the
count (requests *running* only) read as 0 s, and the doctor called the hung replica
queue-bound."""

from __future__ import annotations

import pytest

from gateway.doctor.history import History, read_tick
from gateway.doctor.window import summarise
from gateway.scrape import Sample
from tests.unit.doctor.test_history import Fleet


def _run(steps: list[tuple[float, float, float, bool]]) -> tuple[float, float]:
    """(frozen_s, requests held) of replica 1 after one tick a second; each step is
    (generated tokens so far, running, waiting, scraped this second)."""
    f = Fleet()
    h = History(1.0, 60.0)
    r = f.reps[0]
    for gen, running, waiting, scraped in steps:
        if scraped:
            r.record_scrape(Sample(
                waiting=waiting, running=running, kv_usage=0.1, preemptions=0.0,
                prefix_cache_queries=100.0, prefix_cache_hits=0.0, prompt_tokens=100.0,
                generation_tokens=gen, ttft_sum=0.1, ttft_count=1.0, itl_sum=0.1,
                itl_count=gen, block_size=16, num_gpu_blocks=1000), f.now)
        h.append(read_tick(f.src, f.now, h.layout, False, None))
        f.now += 1.0
    (st,) = [x for x in summarise(list(h.ticks), 30.0, stale_after_s=1.5).replicas
             if x.id == r.id]
    return st.frozen_s, st.frozen_running


def test_an_engine_hung_with_its_requests_all_waiting_is_frozen() -> None:
    steps = [(10.0 * i, 2.0, 0.0, True) for i in range(1, 4)]  # decoding
    steps += [(30.0, 0.0, 6.0, True)] * 8  # hung before scheduling the six it holds
    frozen, held = _run(steps)  # from the first scrape of the final count (the 3rd)
    assert frozen == pytest.approx(8.0) and held == pytest.approx((2 + 8 * 6) / 9)


def test_a_late_last_scrape_counts_up_to_its_own_time() -> None:
    """The scraper fell behind for the last 3 s (a busy host): the frozen time is what the
    scrapes saw (it was 0: the last sample had to be fresh)."""
    steps = [(10.0 * i, 2.0, 0.0, True) for i in range(1, 4)]
    steps += [(30.0, 3.0, 0.0, True)] * 6 + [(30.0, 3.0, 0.0, False)] * 3
    frozen, held = _run(steps)  # the 3rd scrape to the 9th, the last
    assert frozen == pytest.approx(6.0) and held == pytest.approx((2 + 9 * 3) / 10)


def test_ticks_repeating_one_scrape_add_no_time() -> None:
    """Scrapes failing since the counters last moved: the ticks repeat that scrape, which
    says nothing of the seconds after it."""
    steps = [(10.0 * i, 2.0, 0.0, True) for i in range(1, 4)]
    steps += [(30.0, 2.0, 0.0, False)] * 8
    assert _run(steps)[0] == 0.0
    idle = [(10.0, 0.0, 0.0, True)] * 8  # nothing held: not hung, however still
    assert _run(idle)[0] == 0.0
