"""GenerateSession: the generations of one GenerateStream call, and the batching of their outputs.

Each generation runs as its own task over the same function a Generate call streams from, and
appends its messages to the session's outbox; the call's writer takes the whole outbox at once
and sends it as one GenerateStreamResponse. One gRPC message then carries a whole step's outputs
for every request on the stream, instead of one message per request per step, which is what a
Python gRPC stack pays most for on a busy CPU.

The outbox is bounded. A generation that finds it full waits, and what it produces meanwhile piles
up in its request state (the tokenizer merges pending output into one chunk), so a client that
reads slowly costs memory in proportion to its requests' output, never more. The intake is bounded
the same way: the session stops reading instructions while the outbox is full, and gRPC flow
control pushes back on the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from ringserve.errors import AlreadyExists, InvalidArgument, ServiceError, Unavailable
from ringserve.v1 import api_pb2 as pb

log = logging.getLogger(__name__)

Handler = Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]]
OUTBOX_LIMIT = 4096  # messages (outputs and statuses) waiting for the writer


class GenerateSession:
    def __init__(self, handler: Handler, stopping: asyncio.Event | None = None, limit: int = OUTBOX_LIMIT) -> None:
        self.handler = handler
        self.stopping = stopping  # set when the server drains: refuse new work, end when idle
        self.limit = limit
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.outputs: list[pb.GenerateResponse] = []
        self.statuses: list[pb.GenerateStatus] = []
        self.input_done = False
        self._wake = asyncio.Event()  # the outbox or the session's state changed
        self._space = asyncio.Event()  # the outbox has room
        self._space.set()
        self._watcher: asyncio.Task[None] | None = None

    async def serve(self, requests: AsyncIterator[pb.GenerateStreamRequest]
                    ) -> AsyncIterator[pb.GenerateStreamResponse]:
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
        elif rid in self.tasks:
            self._status(rid, AlreadyExists(f"rid: request {rid!r} is already running"))
        elif self.stopping is not None and self.stopping.is_set():
            self._status(rid, Unavailable("the tokenizer is shutting down"))
        else:
            self.tasks[rid] = asyncio.ensure_future(self._run(rid, req))

    def cancel(self, rid: str) -> None:
        """The client gave up on rid: stop it (the handler's cleanup aborts it) and send nothing more."""
        task = self.tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    async def _run(self, rid: str, req: pb.GenerateRequest) -> None:
        outputs = self.handler(req)
        error: ServiceError | None = None
        try:
            async for out in outputs:
                await self._room()
                self.outputs.append(out)
                self._wake.set()
        except ServiceError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - one generation's bug must not end the others
            log.exception("rid=%s generation failed", rid)
            error = ServiceError(f"internal error: {type(e).__name__}: {e}")
        finally:
            # Close now, not at GC: the handler's cleanup aborts an unfinished request at its scheduler.
            await outputs.aclose()
        if self.tasks.get(rid) is asyncio.current_task():
            del self.tasks[rid]
            self._status(rid, error)

    async def _room(self) -> None:
        while len(self.outputs) + len(self.statuses) >= self.limit:
            self._space.clear()
            await self._space.wait()

    def _status(self, rid: str, error: ServiceError | None) -> None:
        if error is None:
            self.statuses.append(pb.GenerateStatus(rid=rid))
        else:
            self.statuses.append(pb.GenerateStatus(rid=rid, code=error.code.value[0], message=error.message))
        self._wake.set()

    # ---- output ----------------------------------------------------------------------------

    def finished(self) -> bool:
        draining = self.stopping is not None and self.stopping.is_set()
        return not self.tasks and (self.input_done or draining)

    async def batches(self) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Everything ready, one message at a time, until the client is done and nothing runs."""
        if self.stopping is not None and self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch_stopping(self.stopping))
        while True:
            if self.outputs or self.statuses:
                batch = pb.GenerateStreamResponse(outputs=self.outputs, statuses=self.statuses)
                self.outputs, self.statuses = [], []
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
        tasks = list(self.tasks.values())
        self.tasks.clear()
        if self._watcher is not None:
            tasks.append(self._watcher)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
