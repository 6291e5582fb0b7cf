"""Many HTTP requests over one long-lived GenerateStream call to the tokenizer.

A per-request Generate call costs a gRPC message per token per request on both ends; on a stream
that the tokenizer batches, one message carries a step's tokens for every request. The reader task
hands each output to its request's Inbox; an Inbox merges what its consumer has not taken yet
(text appended, ids extended), so a slow HTTP client costs memory in proportion to its own output
and never holds up the other requests on the stream.

A request whose consumer stops early (the HTTP client went away) sends `cancel`, which makes the
tokenizer abort it at the scheduler. When the stream breaks, every request on it ends with the
stream's status, and the next request opens a new stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from gateway.errors import from_status
from gateway.streams import append_output
from ringserve.errors import status_of
from ringserve.v1 import api_pb2 as pb
from ringserve.v1 import api_pb2_grpc

log = logging.getLogger(__name__)

SEND_QUEUE = 1024  # instructions waiting for the gRPC write; intake waits when it is full


class Inbox:
    """One request's outputs not yet taken by its consumer, merged per sample, and how it ended."""

    def __init__(self) -> None:
        self.pending: dict[int, pb.GenerateResponse] = {}
        self.event = asyncio.Event()
        self.done = False
        self.code = grpc.StatusCode.OK
        self.message = ""

    def add(self, msg: pb.GenerateResponse) -> None:
        into = self.pending.get(msg.index)
        if into is None:
            self.pending[msg.index] = msg
        else:
            append_output(into, msg)
        self.event.set()

    def end(self, code: grpc.StatusCode, message: str) -> None:
        self.done, self.code, self.message = True, code, message
        self.event.set()

    def take(self) -> list[pb.GenerateResponse]:
        msgs, self.pending = list(self.pending.values()), {}
        return msgs


class GenerateMux:
    """One GenerateStream call and the requests it carries."""

    def __init__(self, stub: api_pb2_grpc.InferenceServiceStub, name: str) -> None:
        self.name = name
        self.inboxes: dict[str, Inbox] = {}
        self.alive = True
        self._outgoing: asyncio.Queue[pb.GenerateStreamRequest | None] = asyncio.Queue(SEND_QUEUE)
        self._pending_sends: set[asyncio.Task[None]] = set()
        self.call = stub.GenerateStream(self._requests())
        self.reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[pb.GenerateStreamRequest]:
        while (msg := await self._outgoing.get()) is not None:
            yield msg

    async def _read(self) -> None:
        code, message = grpc.StatusCode.UNAVAILABLE, "the tokenizer ended the generation stream"
        try:
            async for batch in self.call:
                for out in batch.outputs:
                    box = self.inboxes.get(out.rid)
                    if box is not None:  # else: cancelled here, its last outputs were in flight
                        box.add(out)
                for st in batch.statuses:
                    box = self.inboxes.pop(st.rid, None)
                    if box is not None:
                        box.end(status_of(st.code), st.message)
        except grpc.aio.AioRpcError as e:
            code, message = e.code(), e.details() or e.code().name
        except asyncio.CancelledError:
            code, message = grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down"
        finally:
            self.alive = False
            if self.inboxes:
                log.warning("%s ended (%s: %s) with %d request(s) on it", self.name, code.name, message,
                            len(self.inboxes))
            for box in self.inboxes.values():
                box.end(code, message)
            self.inboxes.clear()

    async def generate(self, req: pb.GenerateRequest,
                       param_map: dict[str, str] | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """The request's messages, as its own Generate call would stream them; raises GatewayError."""
        rid = req.rid
        if not self.alive:
            raise from_status(grpc.StatusCode.UNAVAILABLE, "the generation stream to the tokenizer is closed")
        if rid in self.inboxes:
            raise from_status(grpc.StatusCode.ALREADY_EXISTS, f"rid: request {rid!r} is already running")
        box = self.inboxes[rid] = Inbox()
        try:
            await self._send(pb.GenerateStreamRequest(generate=req), box)
            while True:
                await box.event.wait()
                box.event.clear()
                done, msgs = box.done, box.take()  # read together: an ending comes after its outputs
                for msg in msgs:
                    yield msg
                if done:
                    if box.code != grpc.StatusCode.OK:
                        log.info("rid=%s generate failed: %s %s", rid, box.code.name, box.message)
                        raise from_status(box.code, box.message, param_map)
                    return
        finally:
            if self.inboxes.get(rid) is box:  # not ended: the consumer went away
                del self.inboxes[rid]
                self._send_cancel(rid)
                log.info("rid=%s cancelled (client went away)", rid)

    async def _send(self, msg: pb.GenerateStreamRequest, box: Inbox) -> None:
        """Queue msg for the stream; give up if the request ends first (the stream broke)."""
        try:
            self._outgoing.put_nowait(msg)
            return
        except asyncio.QueueFull:
            pass
        put = asyncio.ensure_future(self._outgoing.put(msg))
        ended = asyncio.ensure_future(box.event.wait())
        try:
            await asyncio.wait({put, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (put, ended):
                t.cancel()

    def _send_cancel(self, rid: str) -> None:
        if not self.alive:
            return
        msg = pb.GenerateStreamRequest(cancel=rid)
        try:
            self._outgoing.put_nowait(msg)
        except asyncio.QueueFull:
            task = asyncio.ensure_future(self._outgoing.put(msg))
            self._pending_sends.add(task)
            task.add_done_callback(self._pending_sends.discard)

    async def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()
        for t in [self.reader, *self._pending_sends]:
            try:
                await t
            except asyncio.CancelledError:
                pass
