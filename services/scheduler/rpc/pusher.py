"""The one long-lived DetokenizerService.Push stream: StepBatches out, resync requests in.

The engine thread hands batches over with `push()` (bounded: it waits while the writer is behind, which
is the backpressure; while the stream is down it drops them, because the resync after reconnecting
re-sends full state). A connect counts once the detokenizer's empty first response arrives
(`ringserve.reconnect.handshake`; without it, try again, so a call stuck in a broken channel cannot
hold the stream down forever). On every (re)connect the stream is marked usable only when the engine
thread sends the resync batch (`on_connect` asks for it), so no delta without its params reaches a fresh
detokenizer ahead of the resync. Each batch carries the stream it was handed over for: one the engine thread
queued just as that stream ended (its put lands on the loop after the stream's queue was cleared) is dropped
by the next stream, not written there ahead of the resync.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

import grpc

from ringserve.grpc_server import client_channel
from ringserve.reconnect import handshake
from ringserve.v1 import detokenizer_pb2, detokenizer_pb2_grpc

log = logging.getLogger(__name__)
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 2.0
QUEUE_BATCHES = 64


class DetokenizerPusher:
    def __init__(self, target: str, scheduler_id: str,
                 on_connect: Callable[[], None], on_resync: Callable[[str], None],
                 on_state: Callable[[bool], Awaitable[None]]) -> None:
        self.target = target
        self.scheduler_id = scheduler_id
        self._on_connect = on_connect      # ask the engine thread for a full resync (it calls mark_live)
        self._on_resync = on_resync        # PushResponse.resync{owner}
        self._on_state = on_state          # health follows the stream
        self._queue: asyncio.Queue = asyncio.Queue()
        self._slots = threading.Semaphore(QUEUE_BATCHES)  # bounds the queue across threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open = False     # the stream is up (set on the loop)
        self._stream = 0       # which stream is (or was last) up: batches are queued with it
        self.live = False      # batches are accepted (set by the engine thread with the resync batch)
        self._stopping = False
        self.batches_sent = 0

    # -- engine thread -----------------------------------------------------------------------------

    def push(self, batch: detokenizer_pb2.StepBatch, resync: bool = False) -> bool:
        """Queue one StepBatch; False if dropped (stream down). A resync batch makes the stream live."""
        if resync and self._open:
            self.live = True
        while self.live and self._open:
            stream = self._stream
            if self._slots.acquire(timeout=0.5):
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (stream, batch))
                return True
        return False

    # -- event loop --------------------------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        backoff = BACKOFF_START_S
        async with client_channel(self.target) as channel:
            stub = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
            while not self._stopping:
                call = stub.Push(wait_for_ready=True)
                try:
                    await call.write(detokenizer_pb2.PushRequest(scheduler_id=self.scheduler_id))
                    if not await handshake(call):
                        raise ConnectionError("no handshake from the detokenizer on the push stream")
                    self._stream += 1
                    self._open = True
                    backoff = BACKOFF_START_S
                    log.info("push stream to detokenizer %s open", self.target)
                    await self._on_state(True)
                    self._on_connect()
                    await self._serve(call)
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, ConnectionError, asyncio.InvalidStateError) as e:
                    # InvalidStateError: a write to a call that ended (the detokenizer died) before the
                    # reader saw it end.
                    log.warning("push stream to %s down: %s", self.target,
                                e.details() if isinstance(e, grpc.aio.AioRpcError) else repr(e))
                except Exception:  # whatever broke, the stream must come back
                    log.exception("push stream to %s failed", self.target)
                finally:
                    was_open = self._open
                    self._open = self.live = False
                    call.cancel()
                    self._clear()
                    if was_open:
                        await self._on_state(False)
                if not self._stopping:
                    await asyncio.sleep(backoff)  # reconnect backoff, not a readiness wait
                    backoff = min(BACKOFF_MAX_S, backoff * 2)

    async def _serve(self, call) -> None:
        reader = asyncio.create_task(self._read(call))
        try:
            while True:
                get = asyncio.create_task(self._queue.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if reader in done:
                    get.cancel()
                    reader.result()  # raises the stream's error
                    raise ConnectionError("the detokenizer closed the push stream")
                item = get.result()
                if item is None:  # flush_and_stop() sentinel: half-close, let the peer finish reading
                    await call.done_writing()
                    await asyncio.wait({reader}, timeout=2.0)
                    return
                self._slots.release()
                stream, batch = item
                if stream != self._stream:  # handed over for a stream that has ended since
                    continue
                await call.write(detokenizer_pb2.PushRequest(batch=batch))
                self.batches_sent += 1
        finally:
            reader.cancel()

    async def _read(self, call) -> None:
        while (resp := await call.read()) is not grpc.aio.EOF:
            if resp.HasField("resync"):
                log.info("resync requested owner=%s", resp.resync.owner or "*")
                self._on_resync(resp.resync.owner)

    def _clear(self) -> None:
        while not self._queue.empty():
            if self._queue.get_nowait() is not None:
                self._slots.release()

    async def flush_and_stop(self) -> None:
        """Send what is queued (up to timeout), then close the stream."""
        self._stopping = True
        if self._open:
            # Through call_soon, so it lands after batches the engine thread queued the same way.
            asyncio.get_running_loop().call_soon(self._queue.put_nowait, None)
