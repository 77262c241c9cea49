"""A replica that takes the connection and the request and never answers (a hung engine, a
wedged proxy in front of one), behind a real Envoy whose cluster walks the picker's list
(``override_host``, ``epp.fallbacks: 1``), health polling slow and the replica's /health 200.

Before: a stream picked there ended with Envoy's per-try idle timeout as the client's 504
"The replica did not answer in time (first byte timeout)." -- the fallback the picker had
named was never tried (the route retried a reset only before the request was sent), where
the HTTP edge retries it on another replica (``first_byte``); and once Envoy did retry, the
picker's first-byte clock still ran from the first try's send, so the fallback's stream, its
head in, was cut as soon as it was held (a 504 with the answer arriving). Now Envoy's
first-byte cut is retried on the next endpoint of the list, whose try has its own first-byte
timeout: every stream is served, and each retry is counted.
"""

from __future__ import annotations

import openai

from gateway.config import UpstreamConfig
from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import metric_values, request_statuses, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
FIRST_BYTE_S = 2.0
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


def test_a_stream_on_a_replica_that_never_answers_is_served_by_the_fallback(
    procs: list[Proc],
) -> None:
    with BadReplica(MODEL) as hung, BadReplica(MODEL) as good:
        hung.answer, hung.rest = b"", b"never"  # waits for a gate nobody sets
        # the fallback's head comes at once, its first event a moment later: the first-byte
        # clock of its try, not of the first one, bounds it
        good.answer = sse_head()
        good.drip = [chunked(CHUNK, last=False), chunked(b"data: [DONE]\n\n")]
        good.drip_s = 0.5
        urls = [hung.url, good.url]
        epp = epp_proc(args=["--policy", "round_robin"], config={
            "pools": {"default": {"served_model": MODEL, "replicas": urls}},
            "epp": {"fallbacks": 1}, "upstream": {"first_byte_timeout_s": FIRST_BYTE_S},
            "health": {"interval_s": 60, "failure_threshold": 5}})
        procs.append(epp.start())
        envoy, base = envoy_proc(
            epp.picker, endpoints=[u.removeprefix("http://") for u in urls],
            upstream=UpstreamConfig(first_byte_timeout_s=FIRST_BYTE_S))
        procs.append(envoy.start())
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        served = []
        for i in range(4):  # round robin: two are picked with the hung replica first
            with client.chat.completions.with_streaming_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"q {i}"}],
                    max_tokens=3, stream=True) as resp:
                assert resp.status_code == 200
                served.append(resp.headers["x-kvgate-replica"].removeprefix("default/"))
                assert "data: [DONE]" in resp.read().decode()
        assert set(served) == {good.url.removeprefix("http://")}
        # the picker counts a request as Envoy tells it the exchange ended, which can come
        # a moment after the client has read the last byte
        wait_for(lambda: request_statuses(epp.base) == {"200": 4}, 10, "the picker's count")
        went_past = metric_values(epp.base, "kvgate_upstream_retries_total")
        assert went_past == {'{pool="default",reason="envoy"}': 2}, went_past
        inflight = metric_values(epp.base, "kvgate_inflight_requests")
        assert set(inflight.values()) == {0.0}, inflight
