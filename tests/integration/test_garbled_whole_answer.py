"""A whole (non-streamed) 200 whose Content-Length frames a JSON object that does not parse (a
replica's or a proxy's bug: ``{"id": "x", "choices": [}``), through both edges (`kvgate serve`;
`kvgate epp` behind a real Envoy) over one loopback replica that answers so. It opens and
closes as an object, so both edges relayed it as a 200 and judged the replica by a success;
the official SDK then failed to decode it. Now it is the 502 "not JSON" at both, a failure
of the replica, as a 200 page that is no JSON object is."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.bad_replica import BadReplica, whole
from tests.support.epp import both_edges
from tests.support.gateway import inflight, metric_values

MODEL = "m"
EDGES = ["http", "envoy"]
GARBLED = {
    "bracket": b'{"id": "x", "choices": [}',
    "unquoted": b'{"id": chatcmpl-1, "choices": []}',
    "trailing-comma": b'{"id": "x", "choices": [],}',
}


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    with BadReplica(MODEL) as replica, both_edges(replica.url, MODEL, {}) as every:
        yield replica, every


def _failures(metrics: str) -> float:
    return sum(metric_values(metrics, "kvgate_replica_failures_total").values())


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("body", GARBLED.values(), ids=GARBLED.keys())
def test_a_framed_json_200_that_does_not_parse_is_a_502_at_both_edges(
    edges: tuple[BadReplica, dict[str, str]], edge: str, body: bytes,
) -> None:
    replica, every = edges
    replica.answer = whole(body)
    metrics = every[f"{edge}-metrics"]
    before = _failures(metrics)
    client = openai.OpenAI(base_url=f"{every[edge]}/v1", api_key="x", max_retries=0,
                           timeout=15)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert err.value.status_code == 502
    assert err.value.body == {"message": "The replica's answer is not JSON (application/json).",
                              "type": "BadGatewayError", "param": None, "code": 502}
    assert _failures(metrics) == before + 1
    assert inflight(metrics) == 0
