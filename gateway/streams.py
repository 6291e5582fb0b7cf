"""Generation streams: per-sample accumulation, merging several streams, client-disconnect races.

Nothing here buffers without bound: merging holds at most one pending message per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from gateway.errors import GatewayError
from ringserve.v1 import api_pb2 as pb
from ringserve.v1 import common_pb2

T = TypeVar("T")


@dataclass
class Sample:
    """One choice's output so far, built from the tokenizer's per-sample messages."""

    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    input_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    meta_info: pb.MetaInfo = field(default_factory=pb.MetaInfo)
    finished: bool = False
    reasoning_text: str = ""
    tool_calls: list[pb.ToolCallDelta] = field(default_factory=list)

    def absorb(self, msg: pb.GenerateResponse) -> None:
        append_output(self, msg)

    @property
    def finish(self) -> common_pb2.FinishReason:
        return self.meta_info.finish_reason


def append_output(into: Sample | pb.GenerateResponse, msg: pb.GenerateResponse) -> None:
    """msg's new text, ids and logprobs after into's; its meta_info (the latest counts) replaces into's."""
    # Once per token per request: the fields most messages leave empty are tested before they are
    # touched (each protobuf field access builds a wrapper; an extend by nothing still costs one).
    into.text += msg.text
    into.output_ids.extend(msg.output_ids)
    if msg.reasoning_text:
        into.reasoning_text += msg.reasoning_text
    if msg.tool_calls:
        into.tool_calls.extend(msg.tool_calls)
    if msg.logprobs:
        into.logprobs.extend(msg.logprobs)
    if msg.input_logprobs:
        into.input_logprobs.extend(msg.input_logprobs)
    if msg.HasField("meta_info"):
        into.meta_info.CopyFrom(msg.meta_info)
    if msg.finished:
        into.finished = True


async def merge(streams: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several streams as they arrive, tagged with the stream's position.

    Closing this generator (client gone) cancels every pending read, which closes the
    underlying gRPC calls.
    """
    if len(streams) == 1:  # the common case, without a task per message
        async for item in streams[0]:
            yield 0, item
        return
    pending: dict[asyncio.Task[T], int] = {
        asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}  # type: ignore[arg-type]
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(anext(streams[i]))] = i  # type: ignore[arg-type]
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            aclose = getattr(s, "aclose", None)
            if aclose is not None:
                await aclose()


async def collect(streams: list[AsyncIterator[pb.GenerateResponse]]) -> list[dict[int, Sample]]:
    """Drain the streams; per stream (prompt), its samples by index."""
    out: list[dict[int, Sample]] = [{} for _ in streams]
    gen = merge(streams)
    try:
        async for i, msg in gen:
            out[i].setdefault(msg.index, Sample(msg.index)).absorb(msg)
    finally:
        await gen.aclose()
    return out


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is http.disconnect: when the client goes
    # away, or when the response is complete (this watcher is cancelled before that).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so its gRPC calls) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise GatewayError(499, "client disconnected", "request_cancelled")
    finally:
        for t in (task, watcher):
            t.cancel()
        for t in (task, watcher):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
