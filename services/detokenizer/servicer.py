"""DetokenizerService over gRPC: the two long-lived streams, converting at the edge with the shared
types (`StepBatch.from_pb` in, `OwnerBatch.to_pb` out).

Push (one per scheduler): step batches in, PushResponse.resync out whenever a tokenizer
(re)subscribes. Subscribe (one per tokenizer replica): that owner's text batches out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from ringserve.errors import InvalidArgument
from ringserve.message import StepBatch
from ringserve.v1 import detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.detokenizer import Detokenizer
from services.detokenizer.metrics import DetokenizerMetrics
from services.detokenizer.subscriptions import Subscriptions

log = logging.getLogger(__name__)
PUSH_OUTBOX = 64  # control messages to one scheduler; resyncs beyond it are dropped with a log line
MERGE_BATCHES = 32  # most queued batches merged into one SubscribeResponse


class _SchedulerLink:
    """One connected Push stream: where resync requests for that scheduler go."""

    def __init__(self) -> None:
        self.scheduler_id = "?"
        self.outbox: asyncio.Queue[detokenizer_pb2.PushResponse | None] = asyncio.Queue(PUSH_OUTBOX)
        # The handshake: an empty first message tells the scheduler this stream is registered here.
        self.outbox.put_nowait(detokenizer_pb2.PushResponse())


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, core: Detokenizer, subs: Subscriptions[detokenizer_pb2.SubscribeResponse],
                 metrics: DetokenizerMetrics | None = None) -> None:
        self.core = core
        self.subs = subs
        self.metrics = metrics
        self.links: set[_SchedulerLink] = set()

    async def handle_batch(self, pb: detokenizer_pb2.StepBatch) -> None:
        """Decode one step and route each owner's text; waits while a subscriber is full."""
        batches, stats = self.core.step(StepBatch.from_pb(pb))
        if self.metrics is not None:
            self.metrics.step_decode.observe(stats.decode_s)
            self.metrics.tokens.inc(stats.tokens)
            self.metrics.requests_tracked.set(len(self.core))
            if stats.deltas_dropped:
                self.metrics.deltas_dropped.inc(stats.deltas_dropped)
        for b in batches:
            await self.subs.publish(b.owner, b.to_pb())

    async def Push(self, request_iterator: AsyncIterator[detokenizer_pb2.PushRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[detokenizer_pb2.PushResponse]:
        link = _SchedulerLink()
        self.links.add(link)
        reader = asyncio.create_task(self._read_push(request_iterator, link))
        try:
            while (msg := await link.outbox.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            self.links.discard(link)
            log.info("scheduler=%s push stream closed", link.scheduler_id)

    async def _read_push(self, requests: AsyncIterator[detokenizer_pb2.PushRequest],
                         link: _SchedulerLink) -> None:
        try:
            async for req in requests:
                if req.scheduler_id and link.scheduler_id != req.scheduler_id:
                    link.scheduler_id = req.scheduler_id
                    log.info("scheduler=%s push stream open", link.scheduler_id)
                if req.HasField("batch"):
                    await self.handle_batch(req.batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream ends; the scheduler reconnects and resyncs
            log.warning("scheduler=%s push stream failed: %s: %s", link.scheduler_id, type(e).__name__, e)
        finally:
            self._put(link, None)

    def request_resync(self, owner: str) -> None:
        """Ask every connected scheduler to re-send the owner's requests."""
        for link in list(self.links):
            self._put(link, detokenizer_pb2.PushResponse(resync=detokenizer_pb2.ResyncRequest(owner=owner)))

    @staticmethod
    def _put(link: _SchedulerLink, msg: detokenizer_pb2.PushResponse | None) -> None:
        try:
            link.outbox.put_nowait(msg)
        except asyncio.QueueFull:
            log.warning("scheduler=%s control queue full: message dropped", link.scheduler_id)

    async def Subscribe(self, request: detokenizer_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[detokenizer_pb2.SubscribeResponse]:
        if not request.owner:
            raise InvalidArgument("owner", "must not be empty")
        sub = self.subs.subscribe(request.owner)
        log.info("owner=%s subscribed; asking %d scheduler(s) to resync", request.owner, len(self.links))
        self.request_resync(request.owner)
        try:
            # The handshake: an empty first message says the subscription is registered, so the
            # tokenizer counts it as up only now (a READY channel alone proves nothing).
            yield detokenizer_pb2.SubscribeResponse()
            while (item := await sub.get()) is not None:
                # Batches that queued while the last message was written go out with it: when the
                # ring, not the forward, sets the pace, the tokenizer gets fewer, larger messages (a
                # message's gRPC cost, not its deltas, is most of either side's CPU per token). The
                # earliest step_sent_at stays, so the hop latency it measures is not understated.
                for more in sub.take_ready(MERGE_BATCHES):
                    item.deltas.extend(more.deltas)
                yield item
        finally:
            self.subs.unsubscribe(sub)
            log.info("owner=%s subscription ended", request.owner)

    def close(self) -> None:
        """Draining: end every Push stream (schedulers reconnect elsewhere) and every Subscribe
        stream after what is already queued."""
        for link in list(self.links):
            if link.outbox.full():  # the end marker must fit; a pending resync no longer matters
                link.outbox.get_nowait()
            link.outbox.put_nowait(None)
        self.subs.close_all()
