"""A replica whose /metrics says a KV-cache usage above 1 (a fraction: vLLM's
``kv_cache_usage_perc`` is 0..1 despite its name; a proxy or an exporter in front of it that
scales it to per cent says 75). The reading was taken as it was: with flow control on, the
replica was full by the KV knee forever, so its pool stayed saturated and every request waited
out its tier's `max_wait_s` to be shed with a 429, while the replica served well. A fraction
above 1 is no reading, as a negative or NaN one is. A real gateway in front of a raw replica
that answers every request."""

from __future__ import annotations

import httpx
import openai

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, whole
from tests.support.gateway import gateway_proc, metric_values, wait_for

PAGE = (b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        b"vllm:kv_cache_usage_perc 75\n")


def test_a_kv_usage_above_one_is_no_reading() -> None:
    with BadReplica("m", answer=whole(CHAT_ANSWER)) as replica:
        replica.pages[b"/metrics"] = PAGE
        config = {"pools": {"p": {"served_model": "m", "replicas": [replica.url]}},
                  "tiers": {"default": {"flow": {"max_wait_s": 2}}},
                  "routing": {"scrape_interval_ms": 100}, "flow": {"enabled": True}}
        gw, base = gateway_proc(config=config)
        with gw:
            rid = replica.url.removeprefix("http://")
            wait_for(lambda: f'{{pool="p",replica="{rid}"}}' in metric_values(
                base, "kvgate_replica_waiting"), what="the replica scraped")
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            answer = client.chat.completions.create(  # (was: 429 after 2 s in the queue)
                model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content == "hello"
            assert metric_values(base, "kvgate_flow_saturated") == {'{pool="p"}': 0.0}
            assert not metric_values(base, "kvgate_replica_kv_usage")
            assert httpx.get(f"{base}/readyz").status_code == 200
