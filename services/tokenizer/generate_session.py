"""GenerateSession: the generations of one GenerateStream call, and the batching of their outputs.

Each generation's intake (tokenize, route, send to the scheduler) runs as its own task; after that
the generation has no task at all. Its samples mark it ready when a delta lands, and the call's
writer collects every ready generation at once and sends what they produced as one
GenerateStreamResponse. One gRPC message then carries a whole step's outputs for every request on
the stream, and a streamed token costs no task switch here, which is what a Python gRPC stack pays
most for on a busy CPU.

The outbox is bounded: the writer collects ready generations only while the outbox has room, and
what a generation produces meanwhile waits in its request state (the tokenizer merges pending
output into one chunk), so a client that reads slowly costs memory in proportion to its requests'
output, never more. The intake is bounded the same way: the session stops reading instructions
while the outbox is full, and gRPC flow control pushes back on the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from ringserve.errors import AlreadyExists, InvalidArgument, ServiceError, Unavailable
from ringserve.v1 import api_pb2 as pb

from .request_state import Wakeup

log = logging.getLogger(__name__)

OUTBOX_LIMIT = 4096  # messages (outputs and statuses) waiting for the writer


class Generations(Protocol):
    """The session's view of the tokenizer manager, in protobuf (servicer.StreamGenerations)."""

    async def start(self, req: pb.GenerateRequest, wakeup: Wakeup) -> Any: ...

    def collect(self, call: Any, into: RepeatedCompositeFieldContainer[pb.GenerateResponse]
                ) -> tuple[bool, ServiceError | None]:
        """Add the new outputs to `into` (built in place: a message added to a batch by value is
        copied); whether the call is done, and the error that ended it."""
        ...

    def release(self, call: Any) -> None: ...


class _Ready:
    """A generation's wakeup: mark it ready and wake the writer."""

    __slots__ = ("session", "rid")

    def __init__(self, session: GenerateSession, rid: str) -> None:
        self.session, self.rid = session, rid

    def set(self) -> None:
        self.session.ready[self.rid] = None
        self.session._wake.set()


class GenerateSession:
    def __init__(self, gens: Generations, stopping: asyncio.Event | None = None, limit: int = OUTBOX_LIMIT) -> None:
        self.gens = gens
        self.stopping = stopping  # set when the server drains: refuse new work, end when idle
        self.limit = limit
        self.starting: dict[str, asyncio.Task[None]] = {}  # intake in progress
        self.running: dict[str, Any] = {}  # rid -> the manager's call
        self.ready: dict[str, None] = {}  # rids with news, in order (a set that keeps order)
        self.outbox = pb.GenerateStreamResponse()  # the next batch, built in place
        self.input_done = False
        self._wake = asyncio.Event()  # a generation has news, or the session's state changed
        self._space = asyncio.Event()  # the outbox has room
        self._space.set()
        self._watcher: asyncio.Task[None] | None = None

    async def serve(self, requests: AsyncIterator[pb.GenerateStreamRequest]
                    ) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        """The whole call: read the client's instructions alongside, yield the batches, and stop
        every generation when the call ends (finished, cancelled or broken)."""
        feed = asyncio.ensure_future(self.feed(requests))
        try:
            async for batch in self.batches():
                yield batch
        finally:
            feed.cancel()
            await self.close()

    # ---- intake ----------------------------------------------------------------------------

    async def feed(self, requests: AsyncIterator[pb.GenerateStreamRequest]) -> None:
        """Start and cancel generations as the client asks, until it half-closes its side."""
        try:
            async for msg in requests:
                await self._room()
                action = msg.WhichOneof("action")
                if action == "generate":
                    self.start(msg.generate)
                elif action == "cancel":
                    self.cancel(msg.cancel)
                else:
                    self._status("", InvalidArgument("action", "one of generate or cancel is required"))
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - the client's side broke; the call's own status tells it
            log.info("generate stream input ended: %s", type(e).__name__)
        finally:
            self.input_done = True
            self._wake.set()

    def start(self, req: pb.GenerateRequest) -> None:
        rid = req.rid
        if not rid:
            self._status("", InvalidArgument("generate.rid", "required on GenerateStream"))
        elif rid in self.starting or rid in self.running:
            self._status(rid, AlreadyExists(f"rid: request {rid!r} is already running"))
        elif self.stopping is not None and self.stopping.is_set():
            self._status(rid, Unavailable("the tokenizer is shutting down"))
        else:
            self.starting[rid] = asyncio.ensure_future(self._start(rid, req))

    async def _start(self, rid: str, req: pb.GenerateRequest) -> None:
        error: ServiceError | None = None
        try:
            call = await self.gens.start(req, _Ready(self, rid))
        except ServiceError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - one generation's bug must not end the others
            log.exception("rid=%s intake failed", rid)
            error = ServiceError(f"internal error: {type(e).__name__}: {e}")
        if self.starting.get(rid) is not asyncio.current_task():
            if error is None:  # cancelled after its intake finished: abort it at the scheduler
                self.gens.release(call)
            return
        del self.starting[rid]
        if error is not None:
            self._status(rid, error)
        else:
            self.running[rid] = call
            _Ready(self, rid).set()  # what arrived during the intake

    def cancel(self, rid: str) -> None:
        """The client gave up on rid: stop it (releasing aborts it at its scheduler), send nothing more."""
        task = self.starting.pop(rid, None)
        if task is not None:
            task.cancel()  # the manager forgets a request whose intake is cut short
        call = self.running.pop(rid, None)
        if call is not None:
            self.ready.pop(rid, None)
            self.gens.release(call)

    async def _room(self) -> None:
        while self._queued() >= self.limit:
            self._space.clear()
            await self._space.wait()

    def _queued(self) -> int:
        return len(self.outbox.outputs) + len(self.outbox.statuses)

    def _status(self, rid: str, error: ServiceError | None) -> None:
        if error is None:
            self.outbox.statuses.add(rid=rid)
        else:
            self.outbox.statuses.add(rid=rid, code=error.code.value[0], message=error.message)
        self._wake.set()

    # ---- output ----------------------------------------------------------------------------

    def _collect(self) -> None:
        """Take the ready generations' outputs, while the outbox has room; end the finished ones."""
        while self.ready and self._queued() < self.limit:
            rid = next(iter(self.ready))
            del self.ready[rid]
            call = self.running.get(rid)
            if call is None:  # cancelled, or news that arrived during its intake
                continue
            try:
                done, error = self.gens.collect(call, self.outbox.outputs)
            except Exception as e:  # noqa: BLE001 - one generation's bug must not end the others
                log.exception("rid=%s generation failed", rid)
                done, error = True, ServiceError(f"internal error: {type(e).__name__}: {e}")
            if done or error is not None:
                del self.running[rid]
                self.gens.release(call)
                self._status(rid, error)

    def finished(self) -> bool:
        draining = self.stopping is not None and self.stopping.is_set()
        return not self.starting and not self.running and (self.input_done or draining)

    async def batches(self) -> AsyncGenerator[pb.GenerateStreamResponse, None]:
        """Everything ready, one message at a time, until the client is done and nothing runs."""
        if self.stopping is not None and self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch_stopping(self.stopping))
        while True:
            self._collect()
            if self._queued():
                batch, self.outbox = self.outbox, pb.GenerateStreamResponse()
                self._space.set()
                yield batch
            elif self.finished():
                return
            else:
                self._wake.clear()
                await self._wake.wait()

    async def _watch_stopping(self, stopping: asyncio.Event) -> None:
        await stopping.wait()
        self._wake.set()

    async def close(self) -> None:
        """The call is over (or cancelled): stop every generation still running."""
        tasks = list(self.starting.values())
        self.starting.clear()
        calls = list(self.running.values())
        self.running.clear()
        self.ready.clear()
        for call in calls:
            self.gens.release(call)
        if self._watcher is not None:
            tasks.append(self._watcher)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
