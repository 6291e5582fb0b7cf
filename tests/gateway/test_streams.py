"""The native stream's rendering, without HTTP or gRPC: what each SSE event holds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from gateway import native_routes
from gateway.sse import prime, sse_response
from ringserve.v1 import api_pb2 as pb


async def _messages(n: int) -> AsyncIterator[pb.GenerateResponse]:
    for k in range(1, n + 1):
        msg = pb.GenerateResponse(rid="r", index=0, text=f" w{k}", output_ids=[100 + k], finished=k == n)
        msg.meta_info.id, msg.meta_info.completion_tokens = "r", k
        if k == n:
            msg.meta_info.finish_reason.type = "length"
        yield msg


async def _events(n: int) -> list[dict]:
    item = native_routes._Item(pb.GenerateRequest(rid="r", stream=True), 0)
    events = await prime(native_routes._stream_events([item], [_messages(n)], False))
    body = sse_response(events, "r").body_iterator
    chunks = [bytes(c) if not isinstance(c, str) else c.encode() async for c in body]
    frames = b"".join(chunks).decode().split("\n\n")
    return [json.loads(f.removeprefix("data: ")) for f in frames if f.startswith("data: {")]


def test_each_event_holds_the_ids_of_its_own_message() -> None:
    """The cumulative output_ids of an event are those up to its message, not what the sample holds by
    the time the chunk is written (the rendering hands the sample's own list to the serializer)."""
    events = asyncio.run(_events(5))
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 4, 5]
    for k, e in enumerate(events, 1):
        assert e["output_ids"] == [100 + i for i in range(1, k + 1)]
        assert e["text"] == "".join(f" w{i}" for i in range(1, k + 1))
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
