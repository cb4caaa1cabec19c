"""Registering gRPC services so that a request body that does not parse never reaches
gRPC's own error path (UNKNOWN, and an ERROR line with a traceback per call: any peer
could fill the log). Each method's deserializer hands such a body on as a
:class:`~kvmem.server.edge.wire.Malformed`, for the server's one guard
(:mod:`kvmem.server.edge.guard`) to refuse as INVALID_ARGUMENT naming the method.

kvmem's own service is registered by :func:`kvmem.server.edge.service.add_to_server`,
its handlers guarded by their decorators. The stock services it serves beside it
(grpc.health.v1, reflection) know nothing of that: :func:`add_guarded` puts the guard
before each of their methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from kvmem.server.edge.guard import Guard
from kvmem.server.edge.wire import deserializer

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


def add_guarded(servicer: Any, service: ServiceDescriptor, server: grpc.aio.Server, guard: Guard) -> None:
    """Serve a stock ``servicer`` of ``service`` (its grpc.aio methods: coroutines,
    async generators, or plain functions) behind ``guard`` (:meth:`Guard.stock`)."""
    register(server, service, lambda method: guard.stock(getattr(servicer, method.name), method))
