"""What a picker's exchange took is given back when gRPC cancels its handler: while it closes,
and while its admission waits on Redis.

Envoy ends an ext_proc stream as soon as it has what it needs; gRPC then cancels the
stream's handler, which may be closing the exchange right then (`Exchange.close`: release
the lease, settle the admission in Redis, probe the endpoints Envoy went past). The close
was cancelled at its first wait: the probe never ran (CI's
test_edges_agree_failover[500-envoy] failed 1 run in 3), and with Redis slow at that moment
the tenant's concurrency lease was never released either (renewed for the process's life: a
tenant with max_concurrency 1 refused from then on; `RateLimiter.finish` now releases it
however its settle ends). Cancelled while its admission waited on Redis, the exchange left
its TPM reservation charged (`RedisRateLimiter`). A real picker with its limits in a real
redis-server, held by a busy script while a real gRPC client playing Envoy's part cancels
the call.
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
TPM = 1000


def _body(max_tokens: int) -> bytes:
    return orjson.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": max_tokens})


USAGE = b'{"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
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
def picker(
    redis_url: str, request: pytest.FixtureRequest,
) -> Iterator[tuple[EppProc, str, list[BadReplica]]]:
    """A picker over two replicas, polled healthy once (and not again), whose tenant may run
    one request at a time (limits in Redis; others as the test's parameter); a key of that
    tenant."""
    limits = getattr(request, "param", {"tpm": TPM, "max_concurrency": 1})
    health = {**FAST_HEALTH, "interval_s": 60, "eject_base_s": 60, "eject_max_s": 60}
    with BadReplica("m", end="close") as a, BadReplica("m", end="close") as b:
        config = {"pools": {"p": {"served_model": "m", "replicas": [a.url, b.url]}},
                  "models": {"llama": {"free": "p"}}, "health": health,
                  "epp": {"fallbacks": 1},
                  "tiers": {"free": {"limits": limits}},
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


async def _sent(stub: Any, key: str, max_tokens: int = 5) -> Any:
    """A new exchange with the request sent whole."""
    call = stub.Process()
    body = _body(max_tokens)
    await call.write(pb.ProcessingRequest(request_headers=_headers({
        ":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json",
        "content-length": str(len(body)), "authorization": f"Bearer {key}"})))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body,
                                                                   end_of_stream=True)))
    return call


async def _picked(stub: Any, key: str) -> tuple[Any, pb.ProcessingResponse]:
    """A new exchange with the request sent whole: the call and the picker's first answer."""
    call = await _sent(stub, key)
    return call, await asyncio.wait_for(call.read(), 10)


async def _remaining(stub: Any, key: str) -> int:
    """The tenant's tokens left after one small request's admission (its answer's
    x-ratelimit-remaining-tokens), the exchange run to its end."""
    call = await _admitted(stub, key)
    await asyncio.wait_for(call.read(), 10)  # the rewritten body
    await call.write(pb.ProcessingRequest(response_headers=_headers(
        {":status": "200", "content-type": "application/json"})))
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
        body=USAGE, end_of_stream=True)))
    head = (await asyncio.wait_for(call.read(), 10)).response_headers.response.header_mutation
    await asyncio.wait_for(call.read(), 10)
    await call.done_writing()
    sent = {h.header.key: h.header.raw_value for h in head.set_headers}
    return int(sent["x-ratelimit-remaining-tokens"])


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


@pytest.mark.parametrize("picker", [{"tpm": TPM, "max_concurrency": 1}, {"tpm": TPM}],
                         ids=["leased", "tpm-only"], indirect=True)
async def test_an_exchange_ended_while_redis_admits_it_gives_back_what_it_took(
    picker: tuple[EppProc, str, list[BadReplica]], redis_url: str,
) -> None:
    """The client leaves (Envoy ends the stream, gRPC cancels the handler) while the
    request's admission waits on Redis: the script still runs when Redis answers, leasing
    the tenant's one slot and reserving the request's ``max_tokens`` 900 of its 1,000 TPM.
    The lease was freed; the reservation stayed charged until the bucket refilled (~54 s),
    though the request never reached a replica. Both are given back; without a concurrency
    limit (no lease to tell that the script ran) the reservation stayed charged: its mark
    tells now."""
    epp, key, _ = picker
    async with grpc.aio.insecure_channel(epp.picker) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        assert await _remaining(stub, key) > TPM - 20  # (its Redis connection is open now)
        hold = asyncio.create_task(_hold(redis_url, 400))
        await asyncio.sleep(0.05)
        call = await _sent(stub, key, max_tokens=900)  # its admission waits on Redis
        await asyncio.sleep(0.15)
        call.cancel()
        await hold
        assert await _remaining(stub, key) > TPM - 60
