"""SchedulerService over gRPC: protobuf in (`TokenizedReq.from_pb`), the engine, protobuf out; nothing else.

Connect: one bidi stream per tokenizer replica. Requests and aborts go to the engine's intake;
LoadReports (after the hello and every interval) and Rejections go back. When the stream ends, every
request the replica owns is aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from ringserve.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from ringserve.message import LoraAdapter, TokenizedReq
from ringserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.core import control
from services.scheduler.core.engine import Engine
from services.scheduler.core.profiler import ProfileOptions
from services.scheduler.core.req import Req
from services.scheduler.rpc.own_thread import in_own_thread

log = logging.getLogger(__name__)
_END = object()  # marks the end of a Connect stream's outgoing queue


# -- the service -----------------------------------------------------------------------------------

class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, get_engine: Callable[[], Engine | None],
                 info: Callable[[], scheduler_pb2.GetSchedulerInfoResponse], load_interval_s: float) -> None:
        self._get_engine = get_engine
        self._info = info
        self.load_interval_s = load_interval_s
        self.draining = False   # refuse new requests (SIGTERM)
        self.closing = False    # end Connect streams (drain finished)
        self.ring = True        # a detokenizer is configured (without one, outputs of Connect could go nowhere)

    def _engine(self) -> Engine:
        engine = self._get_engine()
        if engine is None:
            raise Unavailable("the scheduler is still loading its model")
        return engine

    async def Connect(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.ConnectResponse]:
        engine = self._engine()
        if not self.ring:
            raise FailedPrecondition("this scheduler has no detokenizer (--detokenizer is empty); it serves "
                                     "SGLang's protocol on --sglang-grpc-port only")
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        owner = first.hello.owner
        if not owner:
            raise InvalidArgument("hello.owner", "the first message must carry hello.owner")
        log.info("owner=%s connected", owner)
        out: asyncio.Queue = asyncio.Queue(maxsize=256)  # the reader waits when the client does not read

        async def read() -> None:
            try:
                await self._handle(engine, first, owner, out)
                async for msg in request_iterator:
                    await self._handle(engine, msg, owner, out)
            finally:
                await out.put(_END)

        reader = asyncio.create_task(read())
        try:
            yield scheduler_pb2.ConnectResponse(load=engine.load().to_pb())
            while True:
                try:
                    item = await asyncio.wait_for(out.get(), timeout=self.load_interval_s)
                except TimeoutError:
                    item = scheduler_pb2.ConnectResponse(load=engine.load().to_pb())
                if item is _END or self.closing:
                    break
                yield item
        finally:
            reader.cancel()
            engine.abort_owner(owner)
            log.info("owner=%s disconnected; its requests are aborted", owner)

    async def _handle(self, engine: Engine, msg: scheduler_pb2.ConnectRequest, owner: str,
                      out: asyncio.Queue) -> None:
        rejections = []
        for pb in msg.requests:
            try:
                if self.draining:
                    raise Unavailable("the scheduler is shutting down")
                engine.submit(Req.from_tokenized(TokenizedReq.from_pb(pb), owner))
            except ServiceError as e:  # the inbox refuses what cannot be served; the status goes back
                log.info("rid=%s rejected: %s", pb.rid, e.message)
                rejections.append(scheduler_pb2.Rejection(rid=pb.rid, status_code=e.code.value[0], message=e.message))
        if msg.abort_rids:
            engine.abort(list(msg.abort_rids))
        if rejections:
            await out.put(scheduler_pb2.ConnectResponse(rejections=rejections))

    async def GetLoad(self, request, context) -> scheduler_pb2.GetLoadResponse:
        return scheduler_pb2.GetLoadResponse(load=self._engine().load().to_pb())

    async def GetSchedulerInfo(self, request, context) -> scheduler_pb2.GetSchedulerInfoResponse:
        self._engine()
        return self._info()

    async def FlushCache(self, request, context) -> scheduler_pb2.SchedulerServiceFlushCacheResponse:
        ok, message = await in_own_thread(self._engine().flush_cache)
        return scheduler_pb2.SchedulerServiceFlushCacheResponse(success=ok, message=message)

    # -- operations (core/control.py; each blocks a thread of its own, never the event loop) -------

    async def AbortAll(self, request, context) -> scheduler_pb2.AbortAllResponse:
        n = await in_own_thread(control.abort_all, self._engine(), request.message or "aborted")
        return scheduler_pb2.AbortAllResponse(num_aborted=n)

    async def PauseGeneration(self, request, context) -> scheduler_pb2.SchedulerServicePauseGenerationResponse:
        mode = _PAUSE_MODES.get(request.mode)
        if mode is None:
            raise InvalidArgument("mode", f"unknown pause mode {request.mode}")
        n = await in_own_thread(control.pause, self._engine(), mode)
        return scheduler_pb2.SchedulerServicePauseGenerationResponse(num_requests=n)

    async def ContinueGeneration(self, request, context) -> scheduler_pb2.SchedulerServiceContinueGenerationResponse:
        was = await in_own_thread(control.resume, self._engine())
        return scheduler_pb2.SchedulerServiceContinueGenerationResponse(was_paused=was)

    async def UpdateWeightsFromDisk(self, request,
                                    context) -> scheduler_pb2.SchedulerServiceUpdateWeightsFromDiskResponse:
        if not request.model_path:
            raise InvalidArgument("model_path", "required")
        r = await in_own_thread(control.update_weights, self._engine(), request.model_path,
                                request.load_format, request.abort_all_requests, request.weight_version,
                                request.drain_timeout_s)
        return scheduler_pb2.SchedulerServiceUpdateWeightsFromDiskResponse(success=r.success, message=r.message,
                                                   num_paused_requests=r.num_paused_requests,
                                                   weight_version=r.weight_version)

    async def StartProfile(self, request, context) -> scheduler_pb2.SchedulerServiceStartProfileResponse:
        opts = ProfileOptions(request.output_dir, request.num_steps if request.HasField("num_steps") else None,
                              list(request.activities), request.with_stack, request.record_shapes,
                              request.profile_prefix)
        message = await in_own_thread(control.start_profile, self._engine(), opts)
        return scheduler_pb2.SchedulerServiceStartProfileResponse(message=message)

    async def StopProfile(self, request, context) -> scheduler_pb2.SchedulerServiceStopProfileResponse:
        files = await in_own_thread(control.stop_profile, self._engine())
        return scheduler_pb2.SchedulerServiceStopProfileResponse(trace_files=files)

    async def LoadLoraAdapter(self, request, context) -> scheduler_pb2.SchedulerServiceLoadLoraAdapterResponse:
        rank = await in_own_thread(control.load_lora, self._engine(), LoraAdapter.from_pb(request.adapter))
        return scheduler_pb2.SchedulerServiceLoadLoraAdapterResponse(rank=rank)

    async def UnloadLoraAdapter(self, request, context) -> scheduler_pb2.SchedulerServiceUnloadLoraAdapterResponse:
        if not request.lora_name:
            raise InvalidArgument("lora_name", "required")
        await in_own_thread(control.unload_lora, self._engine(), request.lora_name)
        return scheduler_pb2.SchedulerServiceUnloadLoraAdapterResponse()


_PAUSE_MODES = {scheduler_pb2.PAUSE_MODE_UNSPECIFIED: "abort", scheduler_pb2.PAUSE_MODE_ABORT: "abort",
                scheduler_pb2.PAUSE_MODE_RETRACT: "retract", scheduler_pb2.PAUSE_MODE_IN_PLACE: "in_place"}

