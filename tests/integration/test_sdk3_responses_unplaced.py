"""A gateway without authentication that did not relay a stored response -- it restarted, or
another gateway without Redis relayed it -- finds its replica: `responses.retrieve(id)` and a
`previous_response_id` follow-up reach the replica that stores it (vLLM's store lives there
alone), streamed or not. It was a 404 for the GET while the replica held the response, and a
follow-up went wherever the pick landed (vLLM's 404 on every other replica). An id no
replica holds is still a 404 in OpenAI's shape. Two simulated replicas with the store on,
one `kvgate serve --no-auth`; the responses are created on the replica directly, as a gateway
that restarted since finds them."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import sim_proc

MODEL = "sim-model"


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, str, str]]:
    """(the gateway's base URL, the first replica's, the second's)."""
    a, a_url = sim_proc(None, "--time-scale", "50", "--enable-store", model=MODEL)
    b, b_url = sim_proc(None, "--time-scale", "50", "--enable-store", model=MODEL)
    with a, b:
        gw, base = gateway_proc(upstreams=[a_url, b_url])
        with gw:
            yield base, a_url, b_url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.parametrize("holder", [1, 2], ids=["first replica", "second replica"])
def test_a_response_the_gateway_never_relayed_is_found(
    fleet: tuple[str, str, str], holder: int,
) -> None:
    gateway, replica = _client(fleet[0]), fleet[holder]
    stored = _client(replica).responses.create(model=MODEL, input="Remember 7. " * 20,
                                               max_output_tokens=4)
    where = replica.removeprefix("http://")
    got = gateway.responses.with_raw_response.retrieve(stored.id)
    assert got.parse().id == stored.id
    assert got.headers["x-kvgate-replica"] == f"default/{where}"
    follow = gateway.responses.with_raw_response.create(
        model=MODEL, input="What was it?", previous_response_id=stored.id, max_output_tokens=4)
    assert follow.parse().previous_response_id == stored.id
    assert follow.headers["x-kvgate-replica"] == f"default/{where}"
    assert follow.headers["x-kvgate-route"] == "response-affinity"


def test_a_streamed_follow_up_reaches_the_replica(fleet: tuple[str, str, str]) -> None:
    gateway, replica = _client(fleet[0]), fleet[2]
    stored = _client(replica).responses.create(model=MODEL, input="Stream on. " * 20,
                                               max_output_tokens=4)
    with gateway.responses.with_streaming_response.create(
            model=MODEL, input="And then?", max_output_tokens=4, stream=True,
            previous_response_id=stored.id) as answer:
        assert answer.headers["x-kvgate-route"] == "response-affinity"
        assert answer.headers["x-kvgate-replica"] == f"default/{replica.removeprefix('http://')}"
        events = list(answer.parse())
    assert events[-1].type == "response.completed" or events[-1].type == "response.incomplete"
    assert events[0].type == "response.created"
    assert events[0].response.previous_response_id == stored.id


def test_an_id_no_replica_holds_is_a_404(fleet: tuple[str, str, str]) -> None:
    gateway = _client(fleet[0])
    with pytest.raises(openai.NotFoundError) as info:
        gateway.responses.retrieve("resp_nowhere0123")
    assert info.value.body == {"message": "Response with id 'resp_nowhere0123' not found.",
                               "type": "NotFoundError", "param": "response_id", "code": 404}
    with pytest.raises(openai.NotFoundError):  # the replica's own 404, as before
        gateway.responses.create(model=MODEL, input="x", previous_response_id="resp_nowhere0123")
