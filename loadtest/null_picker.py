"""The floor of an endpoint picker in Python: the same ext_proc exchange as `kvgate epp`
(grpcio aio, ``FULL_DUPLEX_STREAMED`` bodies, destination header + metadata, every response
chunk passed back) with no work of its own: round robin, no parsing, no tenancy, no accounting.

    python -m loadtest.null_picker PORT ENDPOINT [ENDPOINT ...]

`loadtest.bench_epp` runs it beside `kvgate epp` so the protocol's own cost per request (gRPC
messages through grpcio) and kvgate's work on top of it are measured apart, in one run.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from gateway.epp import wire

__all__ = ["main"]


class NullPicker(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, endpoints: list[str]) -> None:
        self._next = itertools.cycle(endpoints)

    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: object,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        chunks: list[bytes] = []
        async for msg in requests:
            kind = msg.WhichOneof("request")
            if kind == "request_body":
                chunks.append(msg.request_body.body)
                if msg.request_body.end_of_stream:
                    body = b"".join(chunks)
                    yield wire.destination_response(next(self._next), len(body), (), ())
                    for answer in wire.body_responses(body, True, request=True):
                        yield answer
            elif kind == "response_headers":
                yield wire.headers_response()
            elif kind == "response_body":
                for answer in wire.body_responses(msg.response_body.body,
                                                  msg.response_body.end_of_stream):
                    yield answer
            elif kind in ("request_trailers", "response_trailers"):
                yield wire.trailers_response(request=kind == "request_trailers")


async def serve(port: int, endpoints: list[str]) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(NullPicker(endpoints), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    asyncio.run(serve(int(args[0]), args[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
