"""Exceptions that carry a gRPC status, and the one interceptor that maps them.

Core code raises these (it never imports grpc status handling); servicers let them propagate.
Anything else that escapes a handler becomes INTERNAL with the exception logged once.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    """A request field is wrong; the message starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    """The call is valid but the server's state refuses it now (e.g. already profiling)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


_STATUS_BY_CODE = {s.value[0]: s for s in grpc.StatusCode}


def status_of(code: int) -> grpc.StatusCode:
    """The status for a google.rpc.Code number carried inside a message (FinishReason, Rejection)."""
    return _STATUS_BY_CODE.get(code, grpc.StatusCode.UNKNOWN)


def error_for_status(status: grpc.StatusCode, message: str) -> ServiceError:
    """Rebuild an exception from a status carried inside a message (e.g. an abort's Finish)."""
    err = ServiceError(message)
    err.code = status
    return err


class _Undecodable:
    """What a unary request deserializes to when its bytes are not the method's message."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """grpc answers an undecodable request with UNKNOWN ("Exception deserializing request"), a
    server fault to the client; hand the handler a marker instead so it can say INVALID_ARGUMENT."""
    if deserialize is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError, and others on odd input
            return _Undecodable(f"{type(e).__name__}: {e}")
    return decode


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turn ServiceError into its status and anything unexpected into INTERNAL, for every method.

    Unary requests whose bytes do not decode are INVALID_ARGUMENT (client error), not UNKNOWN.
    """

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, ServiceError):
        await context.abort(exc.code, exc.message)
    log.exception("unexpected error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _wrap_unary(fn: Callable[..., Any], method: str) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message ({request.reason})")
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the one place that maps every error to a status
            await _abort(context, method, exc)
    return wrapped


def _wrap_stream(fn: Callable[..., Any], method: str) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(fn):
        # A streaming handler written as a coroutine that calls context.write (e.g. health Watch).
        return _wrap_unary(fn, method)

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message ({request.reason})")
        try:
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, method, exc)
    return wrapped
