"""Every error leaves the gateway in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

gRPC status codes map to HTTP the way grpc-gateway maps them; the tokenizer's INVALID_ARGUMENT
message starts with "field: problem", so `param` names the field (in the route's own vocabulary).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"  # overload and restarts are short; clients back off by themselves after that

# gRPC code -> (HTTP status, OpenAI error type)
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "request_cancelled"),  # nginx/grpc-gateway "client closed"
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_HTTP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error"}


class GatewayError(Exception):
    """An error with its HTTP status, raised anywhere in a route and rendered by one handler."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or _HTTP_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def renamed(self, names: dict[str, str]) -> GatewayError:
        """The same error with `param` in another route's vocabulary."""
        if self.param in names:
            self.param = names[self.param]
        return self

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_status(code: grpc.StatusCode, message: str, param_map: dict[str, str] | None = None) -> GatewayError:
    """A gRPC status (from a failed call or an abort finish reason) as a GatewayError."""
    status, type_ = _GRPC_TO_HTTP.get(code, (500, "server_error"))
    param = None
    if code == grpc.StatusCode.INVALID_ARGUMENT and ": " in message:
        field = message.split(": ", 1)[0]
        if field and " " not in field:
            # An element ("sampling_params.stop[1]") maps as its list does: "stop[1]" for OpenAI.
            base, bracket, index = field.partition("[")
            names = param_map or {}
            param = names.get(field) or (names[base] + bracket + index if bracket and base in names else field)
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    return GatewayError(status, message, type_, param, code.name.lower(), headers)


def from_rpc(err: grpc.aio.AioRpcError, param_map: dict[str, str] | None = None) -> GatewayError:
    return from_status(err.code(), err.details() or err.code().name, param_map)


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def install_handlers(app: FastAPI) -> None:
    """OpenAI-shaped bodies for our errors, FastAPI's 422 (as 400), 404/405 and true bugs (500)."""

    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _validation_param(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, param = "request body is not valid JSON", None
        return GatewayError(400, f"{param}: {msg}" if param else msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return GatewayError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return GatewayError(500, f"internal error: {type(exc).__name__}", "server_error").response()
