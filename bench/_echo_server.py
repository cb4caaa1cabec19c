#!/usr/bin/env python3
"""A bare gRPC echo server, the baseline ``rpc_bench.py`` measures kvmem's Step against.

It is set up the way ``kvmem.server.process.app`` sets up the kvmem server, minus kvmem:
grpc.aio on uvloop (one event loop, one thread), the same server options, a unix
socket born 0600, the standard health service (so readiness is awaited the same way),
and SIGTERM/SIGINT for a clean stop. It serves two methods, bytes in and bytes out (no
(de)serialiser: the handlers get the raw request bytes):

- ``/kvmem.bench.Echo/Echo``, unary: one request, one reply (the baseline of kvmem's
  unary ``Step``);
- ``/kvmem.bench.Echo/EchoStream``, a bidirectional stream: one reply per request
  message, in order, for as long as the client keeps the stream open (the baseline of
  kvmem's ``StepStream``: a ping-pong of one message each way per call on one
  long-lived stream). Its handler is an async generator over the request iterator,
  as kvmem's ``StepStream`` handler is.

The first 4 bytes of a request (little-endian uint32) say how long the reply must be;
the reply is a cached bytes object of that size. The client sends a payload the size of
a serialised StepRequest and asks for one the size of the StepResponse, so the bytes on
the wire match and only kvmem's own work (protobuf, the engine, the client's request
building and response parsing) separates the round trips.

Run: ``python bench/_echo_server.py --socket /tmp/x.sock``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVICE = "kvmem.bench.Echo"
METHOD = f"/{SERVICE}/Echo"
STREAM_METHOD = f"/{SERVICE}/EchoStream"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # as kvmem.server.process.app


def payload(request_bytes: int, reply_bytes: int) -> bytes:
    """A request of ``request_bytes`` bytes (at least 4) asking for ``reply_bytes``."""
    if request_bytes < 4 or not 0 <= reply_bytes < 2**32:
        raise ValueError(f"request_bytes must be >= 4 and reply_bytes a uint32, got {request_bytes}, {reply_bytes}")
    return reply_bytes.to_bytes(4, "little") + b"\x00" * (request_bytes - 4)


async def _serve(socket_path: str) -> None:
    replies: dict[bytes, bytes] = {}

    def reply_to(request: bytes) -> bytes:
        key = request[:4]
        reply = replies.get(key)
        if reply is None:
            reply = b"\x01" * int.from_bytes(key.ljust(4, b"\x00"), "little")
            if len(replies) < 64:
                replies[key] = reply
        return reply

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply_to(request)

    async def echo_stream(
        request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        async for request in request_iterator:
            yield reply_to(request)

    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    handlers = {  # bytes in, bytes out
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "EchoStream": grpc.stream_stream_rpc_method_handler(echo_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)  # as the generated kvmem code does

    old_umask = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix:{socket_path}")
        await server.start()
    finally:
        os.umask(old_umask)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(2.0)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="_echo_server.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="unix socket path to listen on")
    args = parser.parse_args(argv)
    import uvloop

    uvloop.run(_serve(args.socket))
    return 0


if __name__ == "__main__":
    sys.exit(main())
