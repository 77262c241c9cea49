"""A replica whose `/metrics` says a count no engine could hold -- 1e306 requests waiting, or
two data-parallel engines' counts that add up past the largest float -- must not break routing
for its pool. The cost `cache_aware` gave it was infinite and a pick raised OverflowError: every
request of the pool was a 500 (the healthy replica beside it never tried), with a traceback
in the gateway's log. Now the sum past any float is no reading (as NaN is) and a cost past
`_MAX_COST_S` ranks the replica last: the requests go to the replica that can serve them.

A real gateway in front of a real simulated replica and a loopback replica serving the page.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import openai
import pytest

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, whole
from tests.support.gateway import gateway_proc, metric_values, request_statuses, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


@pytest.mark.parametrize(("page", "last"), [
    # its queue read: ranked last, every request goes to the simulated replica
    (b"vllm:num_requests_waiting 1e306\nvllm:num_requests_running 1e306\n"
     b"vllm:kv_cache_usage_perc 0.25\n", True),
    # no reading of its queue: it takes requests as an idle replica does
    (b'vllm:num_requests_waiting{engine="0"} 1e308\nvllm:num_requests_waiting{engine="1"} 1e308\n'
     b"vllm:kv_cache_usage_perc 0.25\n", False),
], ids=["huge", "sum-past-float"])
def test_a_replica_reporting_absurd_counts_does_not_break_its_pool(
    sim_factory: SimFactory, page: bytes, last: bool,
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    with BadReplica("m", whole(CHAT_ANSWER)) as bad:
        bad.pages[b"/metrics"] = page
        gw, base = gateway_proc(upstreams=[sim, bad.url], args=["--policy", "cache_aware"])
        with gw:
            kv = f'{{pool="default",replica="{bad.url.removeprefix("http://")}"}}'
            wait_for(lambda: metric_values(base, "kvgate_replica_kv_usage").get(kv) == 0.25,
                     what="the odd page scraped")
            c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
            routed: Counter[str] = Counter()
            for i in range(6):
                raw = c.chat.completions.with_raw_response.create(
                    model="m", max_tokens=2, messages=[{"role": "user", "content": f"q{i}"}])
                raw.parse()
                routed[raw.headers["x-kvgate-replica"]] += 1
            if last:
                assert routed == {f"default/{sim.removeprefix('http://')}": 6}
            assert request_statuses(base) == {"200": 6.0}
            assert "Traceback" not in gw.output(None)
