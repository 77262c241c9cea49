"""Which findings end a stream that already answered (`Lease.on_lost`): its replica found
frozen, down by slow probes with nothing heard, or stalled -- not a refusal or a non-200
`/health` (a killed process resets its connections, a dead engine ends its streams itself),
nor sleep (vLLM lets running requests finish first). A replica whose requests all stream
is found frozen too (before, only one with a request waiting for its first token was)."""

from __future__ import annotations

from contextvars import Context

from gateway.replicas import HealthRules, Lease, Replica
from gateway.scrape import Sample


def _answering(replica: Replica, asked: list[str]) -> Lease:
    lease = replica.acquire(100, stream=True, now=0.0)
    lease.on_stall(lambda: asked.append("waiting"))
    lease.first_token()
    lease.on_lost(lambda: asked.append("answering"))
    return lease


def _replica(**rules: float) -> tuple[Replica, list[str], Lease]:
    replica = Replica("p", "http://127.0.0.1:9", HealthRules(**rules))  # type: ignore[arg-type]
    asked: list[str] = []
    lease = Context().run(_answering, replica, asked)  # (a request's task, not the prober's)
    return replica, asked, lease


def test_a_refusal_or_sleep_leaves_an_answering_stream() -> None:
    replica, asked, _ = _replica()
    replica.mark_down(1.0, request=False, reason="/health: cannot connect")
    replica._judge_sleep(True)
    assert asked == []


def test_a_frozen_replica_whose_requests_all_stream_is_found_and_its_stream_asked() -> None:
    replica, asked, lease = _replica()
    assert replica.inflight_prefill == 0  # (nothing waits for a first token)
    assert replica.frozen(replica.reply_mark(), 1.0, 5.0)
    assert asked == ["answering"]
    replica.frozen(replica.reply_mark(), 2.0, 5.0)  # asked at each finding until released
    assert asked == ["answering", "answering"]
    lease.release()
    replica.frozen(replica.reply_mark(), 3.0, 5.0)
    assert asked == ["answering", "answering"] and not replica.cuttable


def test_slow_probes_with_nothing_heard_ask_it() -> None:
    replica, asked, _ = _replica(slow_threshold=2)
    replica.record_slow_probe(1.0)
    assert asked == []
    replica.record_slow_probe(2.0)
    assert asked == ["answering"]


def test_a_stall_asks_it() -> None:
    replica, asked, _ = _replica(stall_after_s=10.0)
    hung = Sample(running=1.0, waiting=0.0, generation_tokens=100.0, prompt_tokens=10.0)
    replica.record_scrape(hung, 0.0)
    replica.record_scrape(hung, 5.0)
    assert asked == []
    replica.record_scrape(hung, 11.0)
    assert replica.stalled and asked == ["answering"]


def test_an_answering_stream_is_no_wait_for_a_first_event() -> None:
    """kvgate_replica_oldest_wait_seconds reads the leases that can be cut: an answering
    stream is one of them now (`on_lost`), and must not read as a request still waiting."""
    replica, _, answering = _replica()
    assert replica.oldest_wait_s(answering.since + 100.0) == 0.0
    waiting = replica.acquire(100, stream=True, now=0.0)
    waiting.on_stall(lambda: None)
    assert replica.oldest_wait_s(waiting.since + 5.0) == 5.0
    waiting.release()
    answering.release()
