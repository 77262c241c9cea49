"""Replica accounting and the health state machine (time passed in, no sleeps)."""

from __future__ import annotations

import pytest

from gateway.replicas import HealthRules, Replica, RetryBudget, replica_id
from gateway.scrape import Sample
from routing.learning import TtftFit

POLICY = HealthRules(failure_threshold=3, eject_base_s=1.0, eject_max_s=4.0)


def replica() -> Replica:
    return Replica("fp8", "http://127.0.0.1:9001/", POLICY)


@pytest.mark.parametrize(
    ("url", "rid"),
    [("http://10.0.0.1:8000", "10.0.0.1:8000"), ("http://vllm-a/", "vllm-a:80"),
     ("https://vllm-b", "vllm-b:443")],
)
def test_replica_id_is_host_port(url: str, rid: str) -> None:
    assert replica_id(url) == rid


def test_lease_release_is_idempotent_and_restores_counters() -> None:
    r = replica()
    a, b = r.acquire(100), r.acquire(50)
    assert (r.inflight, r.inflight_prefill_tokens) == (2, 150)
    a.first_token()
    assert (r.inflight, r.inflight_prefill_tokens) == (2, 50)
    a.release()
    a.release()
    b.release()
    b.first_token()
    assert (r.inflight, r.inflight_prefill_tokens) == (0, 0)
    assert a.answered and b.answered


def test_release_without_first_token_is_not_answered() -> None:
    r = replica()
    lease = r.acquire(10)
    lease.release()
    assert not lease.answered
    assert (r.inflight, r.inflight_prefill_tokens) == (0, 0)


# (events, expected states after each): "f" failure, "s" success, "tN" = available at time N?
@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ("f f", [True, True]),
        ("f f f", [True, True, False]),
        ("f s f f", [True, True, True, True]),
    ],
)
def test_consecutive_failures_eject(events: str, expected: list[bool]) -> None:
    r = replica()
    seen = []
    for ev in events.split():
        if ev == "f":
            r.record_failure(0.0)
        else:
            r.record_success()
        seen.append(r.available(0.0))
    assert seen == expected


def test_backoff_doubles_then_caps_and_half_open_allows_one_trial() -> None:
    r = replica()
    for _ in range(3):
        r.record_failure(0.0)
    assert r.ejected_until == 1.0
    assert not r.available(0.5)
    assert r.available(1.0)  # half-open: one trial
    trial = r.acquire(1)
    assert not r.available(1.0)  # only one at a time
    trial.release()
    r.record_failure(1.0)  # the trial failed: ejected again, twice as long
    assert r.ejected_until == 3.0
    assert r.available(3.0)
    r.acquire(1).release()  # the next trial (a failure is judged by when it was sent)
    r.record_failure(3.0)
    assert r.ejected_until == 7.0  # 4 s cap
    assert r.available(7.0)
    r.record_success()
    assert r.state == "healthy" and r.ejections == 0 and r.available(7.0)


def test_active_probe_marks_down_once_and_waits_for_backoff() -> None:
    r = replica()
    r.mark_down(0.0)
    assert not r.available(0.0) and not r.probe_due(0.5)
    r.mark_down(0.5)  # already ejected: the back-off is not extended
    assert r.ejected_until == 1.0 and r.probe_due(1.0)


def test_a_replica_marked_down_stays_out_past_its_backoff_until_health_answers() -> None:
    r = replica()
    r.mark_down(0.0)  # refused, a dead engine, /health failing
    assert not r.available(5.0) and r.probe_due(5.0)  # probed, but no trial request
    r.mark_down(5.0, request=False)  # /health still fails
    assert not r.available(60.0)
    r.probe_recovered()  # /health answers: one trial request decides
    assert r.available(60.0) and r.state == "half_open"
    r.mark_down(60.0)  # the trial was refused: down again
    assert not r.available(1000.0)
    r.probe_recovered()
    r.record_success()
    assert r.state == "healthy" and r.available(1000.0)


def test_view_carries_accounting() -> None:
    r = replica()
    r.acquire(40)
    v = r.view(0.0)
    assert (v.id, v.pool, v.healthy, v.inflight, v.inflight_prefill_tokens) == (
        "127.0.0.1:9001", "fp8", True, 1, 40)


def test_a_scrapes_running_leaves_out_our_requests_ended_since() -> None:
    """A turn ended after the scrape that saw it running: the next pick must not charge the
    replica with it (`routing.load.still_running`); one sent after that scrape is not in it."""
    r = replica()
    before = r.acquire(10, now=0.0)
    r.record_scrape(Sample(running=2.0), 1.0)  # ours and another client's
    after = r.acquire(10, now=1.1)
    after.release()  # sent after the scrape: never counted by it
    assert r.view(1.2).running == 2.0
    before.release()
    assert r.view(1.3).running == 1.0
    r.record_scrape(Sample(running=0.0), 1.5)  # a new scrape says it again itself
    assert r.view(1.6).running == 0.0


def test_retry_budget_reserve_then_ratio() -> None:
    budget = RetryBudget(ratio=0.5, reserve=2)
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    budget.deposit()
    assert not budget.try_spend()
    budget.deposit()
    assert budget.try_spend()


BUSY = HealthRules(failure_threshold=3, eject_base_s=1.0, eject_max_s=4.0, slow_threshold=3,
                    busy_backoff_s=0.25, busy_backoff_max_s=1.0)


def test_busy_answers_back_off_new_picks_without_touching_health() -> None:
    r = Replica("p", "http://127.0.0.1:9001", BUSY)
    r.record_failure(0.0)
    r.record_busy(0.0)
    assert not r.view(0.1).healthy  # no new picks while it backs off ...
    assert r.available(0.1) and r.state == "healthy" and r.failures == 1  # ... health as was
    assert r.view(0.25).healthy
    r.record_busy(0.3)  # still busy: twice as long
    assert r.busy_until == 0.8
    r.record_busy(0.8)
    r.record_busy(1.3)
    assert r.busy_until == 2.3  # capped at 1 s
    r.record_busy(10.0)  # quiet for longer than the cap: starts over
    assert r.busy_until == 10.25


def test_a_busy_answers_retry_after_sets_the_back_off_within_the_cap() -> None:
    """A 429's Retry-After was ignored (the back-off was 0.25 s whatever it asked)."""
    r = Replica("p", "http://127.0.0.1:9001", BUSY)
    r.record_busy(0.0, 0.6)
    assert r.busy_until == 0.6  # as asked
    r.record_busy(5.0, 3600)
    assert r.busy_until == 6.0  # at most the longest back-off (1 s)
    r.record_busy(10.0, 0)  # asks for nothing: the usual back-off, not none
    assert not r.view(10.0).healthy
    assert r.busy_until == 10.25


def test_slow_probes_eject_only_in_a_row() -> None:
    r = Replica("p", "http://127.0.0.1:9001", BUSY)
    r.record_slow_probe(0.0)
    r.record_slow_probe(1.0)
    r.record_probe_ok()  # an answer in time resets the count
    r.record_slow_probe(2.0)
    r.record_slow_probe(3.0)
    assert r.state == "healthy"
    r.record_slow_probe(4.0)
    assert r.state == "ejected"


def test_health_answering_again_makes_an_ejected_replica_half_open_only() -> None:
    r = Replica("p", "http://127.0.0.1:9001", BUSY)
    for t in range(3):
        r.record_failure(float(t))  # e.g. EngineFaultedError 503s while /health says 200
    r.probe_recovered()
    assert r.state == "half_open"
    r.record_failure(5.0)  # the trial request fails again: ejected, back-off doubled
    assert r.state == "ejected" and r.ejected_until == 7.0


def test_attempts_and_failures_are_cumulative_and_count_requests_only() -> None:
    """`failures` is health's consecutive count; `attempts` / `failed` are the operators'
    cumulative ones: a success does not reset them, a busy 503 or a failed probe is no
    request failure."""
    r = replica()
    for _ in range(5):
        r.acquire(10).release()
    r.record_failure(0.0)
    r.record_success()
    r.record_busy(0.0)
    r.mark_down(1.0, request=False)  # /health refused
    r.record_slow_probe(2.0)
    r.mark_down(3.0)  # a request refused
    assert (r.attempts, r.failed, r.failures) == (5, 2, 2)


@pytest.mark.parametrize(
    ("before", "after", "restarted"),
    [
        (Sample(prefix_cache_queries=500, prompt_tokens=900), Sample(prefix_cache_queries=0,
                                                                     prompt_tokens=0), True),
        # a new engine starts every counter at 0: one that went on is not a restart (a page
        # missing a data-parallel engine's series for one family)
        (Sample(prompt_tokens=900, generation_tokens=50), Sample(prompt_tokens=910,
                                                                 generation_tokens=2), False),
        (Sample(prompt_tokens=900, generation_tokens=0), Sample(prompt_tokens=20,
                                                                generation_tokens=0), True),
        (Sample(prefix_cache_queries=500), Sample(prefix_cache_queries=640), False),
        (Sample(prefix_cache_queries=500), Sample(), False),  # not exported: no reading
        # a family gone from the page (cut short) says the page is partial, not a restart
        (Sample(prompt_tokens=900, generation_tokens=50), Sample(prompt_tokens=10), False),
    ],
    ids=["all-back", "one-back", "zero-kept", "forward", "missing", "one-gone"],
)
def test_counters_going_back_say_the_engine_restarted(
    before: Sample, after: Sample, restarted: bool,
) -> None:
    r = Replica("p", "http://a:1", HealthRules())
    assert r.record_scrape(before, 1.0) is None  # the first sample: nothing to compare
    assert r.record_scrape(None, 2.0) is None  # a failed scrape says nothing
    assert r.record_scrape(after, 3.0) == ("restarted" if restarted else None)


def _dp_page(engines: dict[str, tuple[int, int, int]]) -> str:
    """A data-parallel vLLM page: (prefix cache queries, prompt, generation tokens) per rank."""
    lines = []
    for family, i in (("vllm:prefix_cache_queries_total", 0), ("vllm:prompt_tokens_total", 1),
                      ("vllm:generation_tokens_total", 2)):
        lines.append(f"# TYPE {family[:-6]} counter")
        lines += [f'{family}{{engine="{e}",model_name="m"}} {v[i]}.0'
                  for e, v in engines.items()]
    return "\n".join(lines) + "\n"


def test_a_page_missing_one_data_parallel_engine_is_not_a_restart() -> None:
    """Rank 1's series of the last family are missing (the page was cut after rank 0's line,
    or rank 1's value was no reading): its sum drops, but the other counters went on, so the
    engines did not restart and the replica's prefix affinity is kept."""
    from gateway.scrape import parse_vllm_metrics

    r = Replica("p", "http://a:1", HealthRules())
    full = _dp_page({"0": (5000, 6000, 700), "1": (4000, 5000, 600)})
    assert r.record_scrape(parse_vllm_metrics(full), 1.0) is None
    page = _dp_page({"0": (5100, 6100, 710), "1": (4100, 5100, 610)})
    cut = page[:page.index('vllm:generation_tokens_total{engine="1"')]
    assert r.record_scrape(parse_vllm_metrics(cut), 2.0) is None
    restarted = _dp_page({"0": (0, 0, 0), "1": (0, 0, 0)})
    assert r.record_scrape(parse_vllm_metrics(restarted), 3.0) == "restarted"


@pytest.mark.parametrize(
    ("reason", "told"),
    [
        ("/health: cannot resolve host vllm-0.pool.svc", "cannot resolve its host name"),
        ("cannot resolve host 10.0.0.7", "cannot resolve its host name"),
        ("/health: cannot connect", "cannot connect"),
        ("/health answered 503", "its health check answered 503"),
        ("its engine died (500)", "its engine died (500)"),
        (None, "down"),
    ],
)
def test_a_down_replicas_condition_names_no_host(reason: str | None, told: str) -> None:
    """What an API client's 503 says of a replica: never its address or host name."""
    r = replica()
    r.mark_down(0.0)
    r.reason = reason
    assert r.condition(0.0) == told


def test_conditions_of_replicas_taking_no_request() -> None:
    r = replica()
    assert r.condition(0.0) == "available"
    r.record_busy(0.0)
    assert r.condition(0.0) == "backing off after busy 503s"
    for _ in range(3):
        r.record_failure(1.0)
    assert r.condition(1.0) == "ejected after failed requests"
    trial = r.acquire(1)  # the back-off expired: half-open, one trial request in flight
    assert r.available(3.0) is False and r.condition(3.0) == "on trial after an ejection"
    trial.release()


FIT = TtftFit(fixed_s=0.02, s_per_token=1 / 8000)  # 8,000 prompt tokens/s


@pytest.mark.parametrize(
    ("others", "hung"),
    [
        ([], True),  # nothing else there: a hung engine
        ([(60_000, True)], False),  # a long streamed prompt in prefill: 7.5 s of work
        ([(60_000, False)], True),  # a non-streamed one: no evidence of prefill to do
        ([(60_000, False), (60_000, True)], False),
    ],
    ids=["alone", "long-stream", "long-whole", "whole-and-stream"],
)
def test_hung_leaves_non_streamed_prompts_out(others: list[tuple[int, bool]], hung: bool) -> None:
    r = replica()
    leases = [r.acquire(tokens, stream) for tokens, stream in others]
    cut = r.acquire(10, True)
    assert r.hung(cut, FIT, waited_s=0.5) is hung
    for lease in [*leases, cut]:
        lease.release()
    assert (r.inflight, r.inflight_prefill, r.inflight_prefill_tokens,
            r.whole_waiting_tokens) == (0, 0, 0, 0)


def test_a_whole_answer_is_progress_and_leaves_no_tokens_behind() -> None:
    r = replica()
    whole = r.acquire(60_000, False)
    cut = r.acquire(10, True)
    whole.first_token()  # the whole answer came while the stream waited
    assert r.whole_waiting_tokens == 0
    assert r.hung(cut, FIT, waited_s=0.5) is False
    whole.release()
    whole.release()
    cut.release()
    assert (r.inflight, r.inflight_prefill_tokens, r.whole_waiting_tokens) == (0, 0, 0)


@pytest.mark.parametrize(
    ("before", "after", "hung"),
    [
        (Sample(generation_tokens=100, prompt_tokens=50),
         Sample(generation_tokens=180, prompt_tokens=50, waiting=1), False),  # decoding others
        (Sample(generation_tokens=100, prompt_tokens=50),
         Sample(generation_tokens=100, prompt_tokens=90, waiting=1), False),  # a prefill moved
        (Sample(generation_tokens=100, prompt_tokens=50),
         Sample(generation_tokens=180, prompt_tokens=50, waiting=0), True),  # nothing queued
        (Sample(generation_tokens=100, prompt_tokens=50),
         Sample(generation_tokens=100, prompt_tokens=50, waiting=1), True),  # counters stopped
        (None, Sample(generation_tokens=100, waiting=1), True),  # nothing to compare with
        (Sample(generation_tokens=100), Sample(waiting=1), True),  # not exported any more
        (Sample(generation_tokens=100), Sample(generation_tokens=3, waiting=1), True),
    ],
    ids=["decoding", "prefilling", "none-waiting", "stopped", "no-sample-before",
         "not-exported", "restarted"],
)
def test_a_cut_stream_is_not_hung_while_the_engine_counters_move(
    before: Sample | None, after: Sample, hung: bool,
) -> None:
    """Non-streamed requests decoding fill the engine (a queued stream sees no first token,
    no answer, no prefill work): only its scrapes show it works -- a queue (requests waiting)
    while its token counters move."""
    r = replica()
    r.record_scrape(before, 0.0)
    decoding = [r.acquire(1, False) for _ in range(2)]
    cut = r.acquire(10, True)
    r.record_scrape(after, 1.0)
    assert r.hung(cut, FIT, waited_s=0.5) is hung
    for lease in [*decoding, cut]:
        lease.release()


@pytest.mark.parametrize(("threshold", "ejected"), [(3, True), (11, False), (1000, False)])
def test_a_raised_failure_threshold_holds_for_the_failure_share_rule_too(
        threshold: int, ejected: bool) -> None:
    """Half of the last 20 requests failed ejects a replica failing every other request, but
    never with fewer failures than `failure_threshold`: an operator who raised it (a pool's
    only replica, a test replica answering badly on purpose) keeps the replica in rotation."""
    r = Replica("p", "http://a:1", HealthRules(failure_threshold=threshold))
    for i in range(40):
        if r.state != "healthy":
            break
        r.record_failure(float(i)) if i % 2 else r.record_success()
    assert (r.state != "healthy") is ejected, r.state
