"""A stored Responses object fetched whole (``GET /v1/responses/{id}``) is bounded as any whole
answer: once its head is in, each gap in its body by `upstream.idle_timeout_s` (not the much
longer first-byte timeout), all of it by the total timeout -- at both edges. The replica is a
scriptable loopback server (`tests/support/bad_replica.py`); the first-byte timeout is far
above the client's own timeout, so only the idle bound can answer in time."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.config import UpstreamConfig
from gateway.stored import NOT_IN_TIME
from tests.support.bad_replica import BadReplica, whole
from tests.support.epp import both_edges, store_through

MODEL = "bad-model"
RID = "resp_whole1"
OBJECT = orjson.dumps({"id": RID, "object": "response", "created_at": 1, "model": MODEL,
                       "output": [], "status": "completed", "text": "x" * 400})
# the first-byte bound (60 s) is beyond the client's patience (10 s): a cut must be the idle one
UPSTREAM = {"first_byte_timeout_s": 60.0, "idle_timeout_s": 1.0, "max_attempts": 1}
EDGES = ["http", "envoy"]


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    # Envoy's own per-try idle bound (3 s) above the picker's idle timeout
    with BadReplica(MODEL) as replica, both_edges(
            replica.url, MODEL, UPSTREAM,
            upstream=UpstreamConfig(first_byte_timeout_s=3.0)) as every:
        bases = {edge: every[edge] for edge in EDGES}
        store_through(replica, bases, MODEL, OBJECT)  # RID stored, through each edge
        yield replica, bases


@pytest.fixture
def replica(edges: tuple[BadReplica, dict[str, str]]) -> Iterator[BadReplica]:
    replica = edges[0]
    replica.gate, replica.end = threading.Event(), "keep"
    yield replica
    replica.rest, replica.get_answer, replica.drip = b"", None, []
    replica.gate.set()


def _parts(answer: bytes, n: int) -> tuple[bytes, list[bytes]]:
    """`answer`'s head with the first of `n` parts of its body; the other parts."""
    head, _, body = answer.partition(b"\r\n\r\n")
    size = -(-len(body) // n)
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return head + b"\r\n\r\n" + parts[0], parts[1:]


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_object_whose_body_stalls_is_cut_by_the_idle_timeout(
    edges: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    first, rest = _parts(whole(OBJECT), 2)
    replica.get_answer, replica.rest = first, b"".join(rest)  # rest: held until the gate
    resp = httpx.get(f"{edges[1][edge]}/v1/responses/{RID}", timeout=10,
                     headers={"x-request-id": "stalled-whole"})
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"] == {"message": NOT_IN_TIME, "type": "GatewayTimeoutError",
                                    "param": None, "code": 504}
    assert resp.headers["x-request-id"] == "stalled-whole"


@pytest.mark.parametrize("edge", EDGES)
def test_a_stored_object_whose_body_moves_slowly_is_answered_whole(
    edges: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str,
) -> None:
    """Gaps under the idle timeout, all of them together over it: the gaps are bounded, not
    the transfer."""
    replica.get_answer, replica.drip = _parts(whole(OBJECT), 5)
    replica.drip_s = 0.4
    resp = httpx.get(f"{edges[1][edge]}/v1/responses/{RID}", timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.content == OBJECT
