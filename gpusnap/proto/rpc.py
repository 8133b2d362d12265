"""gRPC method tables built from service descriptors (no *_pb2_grpc modules).

A servicer is any object with one method per RPC, named as in the .proto;
each takes (request, context) and returns the response message.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor


def _classes(method: MethodDescriptor) -> tuple[type, type]:
    return (
        message_factory.GetMessageClass(method.input_type),
        message_factory.GetMessageClass(method.output_type),
    )


def generic_handler(service: ServiceDescriptor, servicer: Any) -> grpc.GenericRpcHandler:
    """Unary-unary handlers for every method of SERVICE, dispatched to SERVICER."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming or method.server_streaming:
            continue  # the task service has none
        req, resp = _classes(method)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=req.FromString,
            response_serializer=resp.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def unary_stub(channel: grpc.Channel, service: ServiceDescriptor, name: str) -> grpc.UnaryUnaryMultiCallable:
    """A client callable for SERVICE's unary method NAME."""
    method = service.methods_by_name[name]
    req, resp = _classes(method)
    return channel.unary_unary(
        f"/{service.full_name}/{name}",
        request_serializer=req.SerializeToString,
        response_deserializer=resp.FromString,
    )


def stream_stub(channel: grpc.Channel, service: ServiceDescriptor, name: str) -> grpc.UnaryStreamMultiCallable:
    """A client callable for SERVICE's server-streaming method NAME."""
    method = service.methods_by_name[name]
    req, resp = _classes(method)
    return channel.unary_stream(
        f"/{service.full_name}/{name}",
        request_serializer=req.SerializeToString,
        response_deserializer=resp.FromString,
    )


def bidi_stub(channel: grpc.Channel, service: ServiceDescriptor, name: str) -> grpc.StreamStreamMultiCallable:
    """A client callable for SERVICE's bidirectional-streaming method NAME (content Write)."""
    method = service.methods_by_name[name]
    req, resp = _classes(method)
    return channel.stream_stream(
        f"/{service.full_name}/{name}",
        request_serializer=req.SerializeToString,
        response_deserializer=resp.FromString,
    )
