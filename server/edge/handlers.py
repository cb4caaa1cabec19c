"""Registering gRPC services so that a request body that does not parse never reaches
gRPC's own error path (UNKNOWN, and an ERROR line with a traceback per call: any peer
could fill the log). Each method's deserializer hands such a body on as a
:class:`~kvmem.server.edge.wire.Malformed`.

kvmem's own service refuses it in its handlers (:func:`kvmem.server.edge.service.add_to_server`).
The stock services it serves beside it (grpc.health.v1, reflection) know nothing of
that: :func:`add_guarded` puts a guard before each of their methods, which refuses a
malformed request as INVALID_ARGUMENT naming the method and the message type, and
counts it in the service's rate-limited :class:`~kvmem.server.edge.refusals.RefusalLog`.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from kvmem.server.edge.refusals import RefusalLog
from kvmem.server.edge.wire import Malformed, deserializer
from kvmem.server.edge.wire import to_status as _to_status
from kvmem.server.errors import KVMemError

_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def register(server: grpc.aio.Server, service: ServiceDescriptor, behaviour: Callable[[MethodDescriptor], Any]) -> None:
    """Serve every method of ``service`` on ``server`` with ``behaviour(method)`` as its
    handler, as a generated ``add_*Servicer_to_server`` would, but with deserializers
    that return a :class:`Malformed` instead of raising."""
    handlers = {}
    for method in service.methods:
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            behaviour(method),
            request_deserializer=deserializer(message_factory.GetMessageClass(method.input_type)),
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def add_guarded(servicer: Any, service: ServiceDescriptor, server: grpc.aio.Server, refusals: RefusalLog) -> None:
    """Serve a stock ``servicer`` of ``service`` (its grpc.aio methods: coroutines,
    async generators, or plain functions) behind the guard of the module's docstring."""
    register(server, service, lambda method: _guard(getattr(servicer, method.name), method, refusals))


def _guard(handler: Any, method: MethodDescriptor, refusals: RefusalLog) -> Any:
    """``handler`` behind a check of its request (or of each request of a stream)."""
    name = f"{method.containing_service.full_name}/{method.name}"

    async def refuse(context: grpc.aio.ServicerContext, request: Malformed) -> None:
        err: KVMemError = request.error(name)
        refusals.record(context.peer(), name, err.reason.name, err.message)
        await context.abort_with_status(_to_status(err))

    async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Malformed):
                await refuse(context, request)
            yield request

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if method.client_streaming:
            request = checked(request, context)
        elif isinstance(request, Malformed):
            await refuse(context, request)
        try:
            result = handler(request, context)
            return await result if inspect.isawaitable(result) else result
        except NotImplementedError:  # the stock stubs' methods that the servicer leaves out (Health/List)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented by this server")

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if method.client_streaming:
            request = checked(request, context)
        elif isinstance(request, Malformed):
            await refuse(context, request)
        async for response in handler(request, context):
            yield response

    # grpc.aio takes a server-streaming handler as an async generator or as a coroutine
    # that writes with context.write (the health servicer's Watch): keep the handler's kind.
    return stream if inspect.isasyncgenfunction(handler) else call
