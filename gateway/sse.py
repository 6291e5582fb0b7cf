"""Server-sent events as OpenAI and SGLang frame them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`.

A stream that fails after the 200 went out cannot change its status any more, so the error
travels as one last event, `data: {"error": {...}}`, followed by [DONE] (OpenAI's clients raise
APIError on it; SGLang's do the same).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import orjson
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from gateway.errors import GatewayError

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any] | BaseModel) -> bytes:
    # orjson: one chunk per token per request is the gateway's hottest path.
    body = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else orjson.dumps(payload)
    return b"data: " + body + b"\n\n"


async def _framed(events: AsyncIterator[dict[str, Any] | BaseModel], rid: str) -> AsyncIterator[bytes]:
    try:
        async for payload in events:
            yield event(payload)
    except GatewayError as e:
        log.info("rid=%s stream failed: %d %s", rid, e.status, e.message)
        yield event(e.body())
    except Exception as e:  # noqa: BLE001 - a bug must still end the stream in the documented way
        log.exception("rid=%s stream failed with a bug", rid)
        yield event(GatewayError(500, f"internal error: {type(e).__name__}", "server_error").body())
    finally:
        # Closing here (also on cancellation, when the client went away) closes the gRPC calls.
        await _aclose(events)
    yield DONE


def sse_response(events: AsyncIterator[dict[str, Any] | BaseModel], rid: str) -> StreamingResponse:
    return StreamingResponse(_framed(events, rid), media_type="text/event-stream", headers=SSE_HEADERS)


async def prime(events: AsyncIterator[T]) -> AsyncIterator[T]:
    """Wait for the first event before the 200 goes out, so that errors at intake (bad argument,
    overload, unknown model) keep their HTTP status instead of becoming an error event."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        return _empty()
    except BaseException:
        await _aclose(events)
        raise

    async def rest() -> AsyncIterator[T]:
        try:
            yield first
            async for item in events:
                yield item
        finally:
            await _aclose(events)
    return rest()


async def _empty() -> AsyncIterator[Any]:
    return
    yield


async def _aclose(it: AsyncIterator[Any]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()
