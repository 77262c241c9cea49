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

import time
from collections.abc import Callable

import openai
import pytest

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


def _too_many(retry_after: str | None) -> bytes:
    head = b"retry-after: %s\r\n" % retry_after.encode() if retry_after is not None else b""
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n" + head
            + b"content-length: %d\r\n\r\n" % len(BODY) + BODY)


def test_a_replicas_retry_after_sets_its_back_off(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    """The replica asked for 5 s (within `health.busy_backoff_max_s`): it gets no new pick
    for that long. The back-off ignored it: 0.05 s, doubling, so it was asked again and
    again within a second."""
    _, sim = sim_factory(model=MODEL)
    with BadReplica(MODEL, answer=_too_many("5")) as limited:
        gw, base = gateway_proc(
            upstreams=[limited.url, sim], args=["--policy", "round_robin"],
            env={"KVGATE_HEALTH__BUSY_BACKOFF_S": "0.05",
                 "KVGATE_HEALTH__BUSY_BACKOFF_MAX_S": "30"})
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=15)
            started = time.monotonic()
            for i in range(12):
                answer = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2)
                assert answer.status_code == 200
                time.sleep(0.1)  # the back-offs it used to get: 0.05, 0.1, 0.2, 0.4, 0.8 s
            assert time.monotonic() - started < 4.5
            assert limited.posts == 1


@pytest.mark.parametrize("said", ["0", "-2", "whenever", "Wed, 21 Oct 2015 07:28:00 GMT"],
                         ids=["zero", "negative", "garbage", "past-date"])
def test_a_retry_after_of_zero_or_unusable_gets_the_usual_back_off(
    sim_factory: Callable[..., tuple[Proc, str]], said: str,
) -> None:
    """``Retry-After: 0`` was taken as said: no back-off at all, so round robin sent the
    limited replica every other request. It (and garbage) gets the usual back-off now, here
    5 s: the replica is asked once in the run."""
    _, sim = sim_factory(model=MODEL)
    with BadReplica(MODEL, answer=_too_many(said)) as limited:
        gw, base = gateway_proc(
            upstreams=[limited.url, sim], args=["--policy", "round_robin"],
            env={"KVGATE_HEALTH__BUSY_BACKOFF_S": "5", "KVGATE_HEALTH__BUSY_BACKOFF_MAX_S": "30"})
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=15)
            for i in range(8):
                answer = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2)
                assert answer.status_code == 200
            assert limited.posts == 1


@pytest.mark.parametrize(("said", "relayed"), [
    ((None, None), "1"),  # neither said: their back-offs end within a second
    (("7", None), "1"),  # the other one may take it within a second
    (("30", "7"), "7"),  # the soonest either said
    (("0", "0"), "1"),  # "at once" is the usual back-off's second, not "0" (a retry loop)
    (("-1", "soon"), "1"),  # neither is a number of seconds
], ids=["none", "one", "both", "zero", "garbage"])
def test_every_replica_answering_429_gives_the_soonest_retry_after(
    said: tuple[str | None, str | None], relayed: str,
) -> None:
    """The last try's 429 was relayed with its own Retry-After, or none: the client waited
    what one replica said (or its SDK's own guess) while another took requests sooner."""
    with BadReplica(MODEL, answer=_too_many(said[0])) as one, \
            BadReplica(MODEL, answer=_too_many(said[1])) as two:
        gw, base = gateway_proc(upstreams=[one.url, two.url])
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=15)
            with pytest.raises(openai.RateLimitError) as err:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert err.value.response.headers.get_list("retry-after") == [relayed]
            assert one.posts == two.posts == 1  # both were tried
