"""Is a replica's engine stalled? A pure judge of its scraped progress counters.

A hung vLLM engine keeps its sockets open: ``/health`` answers 200 (it reports only the
engine's errored flag) and ``/metrics`` stays readable, but no token comes out for any
request. Streams see that at their first-byte or idle timeout; a non-streamed answer comes
whole after its last token, so nothing but `upstream.total_timeout_s` bounded its wait. The
engine's own counters show it: requests there (``vllm:num_requests_running`` or
``_waiting`` > 0 -- a stuck engine's gauges keep their last values --, or kvgate's own
requests there still waiting for their answer to start: not one the engine finished that
kvgate still relays to a slow client) while the tokens it processed
(``vllm:generation_tokens_total`` plus ``vllm:prompt_tokens_total``, which vLLM counts when a
prefill completes) have not moved for `health.stall_after_s`.

The judge fails open: a failed scrape (unreadable, late, an error page), a page without the
generation counter (not vLLM) or a counter that went back (a restart) starts the evidence
over, so only an unbroken run of good scrapes showing no progress makes a stall. The clock
starts when the replica was first seen busy at that value, never earlier: a replica idle for
an hour is not stalled by the request that just reached it. No I/O, no clock of its own:
samples and times are passed in.

A stall ends when the tokens move again, or when nothing is left there (kvgate cut its
requests and the engine's gauges say none): the replica then gets its half-open trial after
its back-off, and a trial on an engine still hung is found stalled again (a longer back-off).
Holding it out until its counters move would keep out forever a replica that only needed a
request to show it works.

A replica whose pages carry no counters (``--disable-log-stats``) is judged on kvgate's own
evidence instead (`BlindWatch`): streams of kvgate's waiting there for their first event, no
non-streamed request among them (their answers come whole, after all of their decode: no
sign either way), and nothing from its engine -- no first event, no whole answer, no streamed
event of any request (keep-alive comments come from its API server) -- for
`health.stall_after_s`. Its /health and /metrics answering say
nothing of its engine (a hung one's answer 200).
"""

from __future__ import annotations

from gateway.scrape import Sample

__all__ = ["BLIND_MARGIN", "BlindWatch", "StallWatch", "progress"]

# a silence judged a stall where no counters are scraped lasts at least this many times the
# longest first-event wait a stream was served with there (`BlindWatch`)
BLIND_MARGIN = 2.0


def progress(sample: Sample) -> float | None:
    """Tokens the engine has processed (generated plus prefilled), or None when the page has
    no generation counter (a backend that is not vLLM)."""
    if sample.generation_tokens is None:
        return None
    return sample.generation_tokens + (sample.prompt_tokens or 0.0)


class StallWatch:
    """One replica's stall evidence. `after_s` None or 0: never stalled (disabled)."""

    __slots__ = ("_since", "_value", "after_s")

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s
        self._value: float | None = None  # progress when the current run began
        self._since = 0.0  # when it began: the first good, busy scrape at that value

    def observe(self, sample: Sample | None, inflight: int, now: float) -> bool:
        """One scrape's outcome (`sample` None: it failed) with kvgate's own requests in
        flight there at that time: is the engine stalled now?"""
        if not self.after_s or sample is None:
            return self._reset()
        value = progress(sample)
        busy = (sample.running or 0.0) > 0 or (sample.waiting or 0.0) > 0 or inflight > 0
        if value is None or not busy:
            return self._reset()
        if value != self._value:  # moved on (or went back: a restart), a new baseline
            self._value, self._since = value, now
            return False
        return now - self._since >= self.after_s

    def _reset(self) -> bool:
        self._value = None
        return False


class BlindWatch:
    """One replica's stall evidence where no counters are scraped. `after_s` None or 0:
    never stalled (disabled)."""

    __slots__ = ("_mark", "_since", "after_s")

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s
        self._mark: int | None = None  # its output count when the current run began
        self._since = 0.0

    def observe(self, mark: int, streams_waiting: bool, now: float,
                longest_first_s: float = 0.0) -> bool:
        """`mark`: a count that moves with anything its engine sends (first events, whole
        answers, streamed events); `streams_waiting`: streams of ours wait there for their
        first event, and no non-streamed request does; `longest_first_s`: the longest a
        stream waited there for its first event and got it. Is the engine stalled now?"""
        if not self.after_s or not streams_waiting:
            self._mark = None
            return False
        if mark != self._mark:  # output since (or the first look): a new run
            self._mark, self._since = mark, now
            return False
        # silence alone cannot tell a hung engine from one busy with work kvgate does not see
        # (a long prefill, a queue behind other gateways' or clients' requests, a proxy
        # buffering its events): a wait it has already served healthily, with a margin, is
        # not judged (before, each such wait past `after_s` was run twice and its replica
        # ejected)
        return now - self._since >= max(self.after_s, BLIND_MARGIN * longest_first_s)
