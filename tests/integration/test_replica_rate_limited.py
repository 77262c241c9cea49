"""A replica answering 429 (vLLM sends none: something rate-limiting in front of that replica)
while another replica has room: the request is tried on the other one before anything reached
the client, and the replica gets the busy back-off from new picks, as for vLLM's busy 503.
kvgate used to relay the 429 at once: with round robin every other request was refused while
half the pool sat idle. The last try still relays the 429 with its Retry-After
(tests/integration/test_cut_answers.py).

A real gateway, the official openai client, a loopback replica that answers 429 and a
simulated one.
"""

from __future__ import annotations

from collections.abc import Callable

import openai

from tests.support.bad_replica import BadReplica
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

MODEL = "m"
BODY = b'{"error": {"message": "slow down", "type": "RateLimitError", "code": 429}}'
TOO_MANY = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            b"retry-after: 7\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY)


def test_a_replicas_429_is_tried_on_another_replica(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory(model=MODEL)
    with BadReplica(MODEL, answer=TOO_MANY) as limited:
        gw, base = gateway_proc(upstreams=[limited.url, sim], args=["--policy", "round_robin"])
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=15)
            for i in range(6):
                answer = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2)
                assert answer.status_code == 200
                assert answer.headers["x-kvgate-replica"].endswith(sim.removeprefix("http://"))
            assert limited.posts >= 1  # it was tried, and passed over
