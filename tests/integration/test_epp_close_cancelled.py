"""An exchange's end runs to its end when gRPC cancels the picker's handler while it closes.

Envoy ends an ext_proc stream as soon as it has what it needs; gRPC then cancels the
stream's handler, which may be closing the exchange right then (`Exchange.close`: release
the lease, settle the admission in Redis, probe the endpoints Envoy went past). The close
was cancelled at its first wait: the probe never ran (CI's
test_edges_agree_failover[500-envoy] failed 1 run in 3), and with Redis slow at that moment
the tenant's concurrency lease was never released either (renewed for the process's life: a
tenant with max_concurrency 1 refused from then on; `RateLimiter.finish` now releases it
however its settle ends). A real picker with its limits in a real redis-server, held by a
busy script while a real gRPC client playing Envoy's part cancels the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import orjson
import pytest
import redis.asyncio as aioredis
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from gateway.epp.wire import DESTINATION
from tests.support.bad_replica import BadReplica
from tests.support.epp import EppProc, epp_proc
from tests.support.gateway import AUTH_SECRET, FAST_HEALTH, admin_client, metric_values, wait_for

ADMIN = "epp-close-admin-token-0123456789"
BODY = orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 5})
# vLLM's 500 for one request (not its dead engine's)
E500 = b'{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}'
# keeps the server busy for ARGV[1] ms: every other command waits behind it
HOLD = """
local t = redis.call('TIME')
local stop = t[1] * 1000000 + t[2] + ARGV[1] * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= stop
return 1
"""


@pytest.fixture
def picker(redis_url: str) -> Iterator[tuple[EppProc, str, list[BadReplica]]]:
    """A picker over two replicas, polled healthy once (and not again), whose tenant may run
    one request at a time (limits in Redis); a key of that tenant."""
    health = {**FAST_HEALTH, "interval_s": 60, "eject_base_s": 60, "eject_max_s": 60}
    with BadReplica("m", end="close") as a, BadReplica("m", end="close") as b:
        config = {"pools": {"p": {"served_model": "m", "replicas": [a.url, b.url]}},
                  "models": {"llama": {"free": "p"}}, "health": health,
                  "epp": {"fallbacks": 1},
                  "tiers": {"free": {"limits": {"tpm": 100_000, "max_concurrency": 1}}},
                  "tenants": [{"id": "acme", "tier": "free"}]}
        env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
               "KVGATE_REDIS_URL": redis_url}
        epp = epp_proc(config=config, env=env, auth=True)
        with epp:
            for replica in (a, b):
                wait_for(partial(_polled, epp, replica), what="the replica polled healthy")
            with admin_client(epp.base, ADMIN) as admin:
                key: str = admin.post("/tenants/acme/keys").json()["key"]
            yield epp, key, [a, b]


def _healthy(epp: EppProc, replica: BadReplica) -> float | None:
    key = f'{{pool="p",replica="{replica.url.removeprefix("http://")}"}}'
    return metric_values(epp.base, "kvgate_replica_healthy").get(key)


def _polled(epp: EppProc, replica: BadReplica) -> bool:
    return _healthy(epp, replica) == 1


async def _hold(redis_url: str, ms: int) -> None:
    """Keep the server busy for `ms`: every other client's command waits behind it."""
    holder = aioredis.Redis.from_url(redis_url)  # no socket timeout: it waits for Redis
    try:
        await holder.eval(HOLD, 0, str(ms))
    finally:
        await holder.aclose()


def _headers(pairs: dict[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


async def _picked(stub: Any, key: str) -> tuple[Any, pb.ProcessingResponse]:
    """A new exchange with the request sent whole: the call and the picker's first answer."""
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers({
        ":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json",
        "content-length": str(len(BODY)), "authorization": f"Bearer {key}"})))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY,
                                                                   end_of_stream=True)))
    return call, await asyncio.wait_for(call.read(), 10)


async def _admitted(stub: Any, key: str) -> Any:
    """An exchange admitted within 2 s (the tenant's one slot free): its call, the rewritten
    body still to read. The exchanges refused meanwhile (429) are ended."""
    for _ in range(40):
        call, first = await _picked(stub, key)
        if not first.HasField("immediate_response"):
            mutation = first.request_headers.response.header_mutation
            assert any(h.header.key == DESTINATION for h in mutation.set_headers)
            return call
        assert first.immediate_response.status.code == 429  # the tenant's one slot is held
        call.cancel()
        await asyncio.sleep(0.05)
    raise AssertionError("the tenant's concurrency lease was never released")


async def test_a_close_cancelled_while_redis_settles_runs_to_its_end(
    picker: tuple[EppProc, str, list[BadReplica]], redis_url: str,
) -> None:
    """Envoy went past the first endpoint (its connection refused) to one that answered
    vLLM's 500 for the request; the stream ends and gRPC cancels the handler while the close
    waits on Redis. The close goes on: the endpoint passed over is probed and marked down,
    and the tenant's one slot is free for its next request."""
    epp, key, replicas = picker
    for replica in replicas:
        replica.refuse()
    async with grpc.aio.insecure_channel(epp.picker) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call, first = await _picked(stub, key)
        mutation = first.request_headers.response.header_mutation
        sent = {h.header.key: h.header.raw_value for h in mutation.set_headers}
        passed, served = sent[DESTINATION].decode().split(",")
        await asyncio.wait_for(call.read(), 10)  # the rewritten body
        metadata = Struct()
        metadata.update({"x-gateway-destination-endpoint-served": served})
        await call.write(pb.ProcessingRequest(
            response_headers=_headers({":status": "500", "content-type": "application/json"}),
            metadata_context=Metadata(filter_metadata={"envoy.lb": metadata})))
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
            body=E500, end_of_stream=True)))
        for _ in range(2):  # the whole answer's head and body: the request is answered
            await asyncio.wait_for(call.read(), 10)
        hold = asyncio.create_task(_hold(redis_url, 400))
        await asyncio.sleep(0.05)
        await call.done_writing()  # the stream's end: the picker closes the exchange, its
        await asyncio.sleep(0.15)  # settle waiting behind the held server, and Envoy
        call.cancel()  # ends the stream meanwhile
        await hold
        gone = next(r for r in replicas if r.url.endswith(passed))
        wait_for(lambda: _healthy(epp, gone) == 0, timeout=3,
                 what="the endpoint passed over probed and marked down")
        (await _admitted(stub, key)).cancel()  # the tenant's slot is free again
