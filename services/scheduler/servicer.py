"""SchedulerService over gRPC: protobuf <-> engine dataclasses, and nothing else.

Connect: one bidi stream per tokenizer replica. Requests and aborts go to the engine's intake;
LoadReports (after the hello and every interval) and Rejections go back. When the stream ends, every
request the replica owns is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from ringserve.errors import InvalidArgument, Unavailable
from ringserve.finish import finish_to_pb
from ringserve.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.engine import Engine, Load, QueueFull
from services.scheduler.outputs import ReqOutput
from services.scheduler.req import Req, ReqTimings
from services.scheduler.sampling import SamplingParams

log = logging.getLogger(__name__)
_END = object()  # marks the end of a Connect stream's outgoing queue
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]


# -- conversions -----------------------------------------------------------------------------------

def req_from_pb(pb: scheduler_pb2.TokenizedRequest, owner: str) -> Req:
    return Req(rid=pb.rid, owner=pb.owner or owner, origin_input_ids=list(pb.input_ids),
               params=SamplingParams.from_pb(pb.sampling_params), stream=pb.stream,
               return_logprob=pb.return_logprob, top_logprobs_num=pb.top_logprobs_num,
               logprob_start_len=pb.logprob_start_len if pb.HasField("logprob_start_len") else -1,
               timings=ReqTimings(arrival=time.monotonic(), sent_at=pb.sent_at, arrived_at=time.time()))


def output_to_pb(o: ReqOutput) -> detokenizer_pb2.TokenDelta:
    d = detokenizer_pb2.TokenDelta(rid=o.rid, offset=o.offset, ids=o.ids, cached_tokens=o.cached_tokens)
    if o.decode_params is not None:
        p = o.decode_params
        d.params.CopyFrom(detokenizer_pb2.DecodeParams(
            owner=p.owner, stop=p.stop, no_stop_trim=p.no_stop_trim, skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens, stream=p.stream,
            prompt_tokens=p.prompt_tokens))
    if o.logprobs is not None:
        tops = o.top_logprobs or [None] * len(o.ids)
        d.logprobs.extend(_logprobs_pb(zip(o.ids, o.logprobs, tops)))
    if o.input_logprobs is not None:
        d.input_logprobs.extend(_logprobs_pb(o.input_logprobs))
    if o.finish is not None:
        d.finish.CopyFrom(finish_to_pb(o.finish))
    if o.timings is not None:
        t = o.timings
        d.timings.CopyFrom(common_pb2.Timings(to_scheduler_s=t.to_scheduler_s, queue_s=t.queue_s,
                                              prefill_s=t.prefill_s, decode_s=t.decode_s))
    return d


def _logprobs_pb(entries) -> list[common_pb2.TokenLogprob]:
    """(token id, logprob or None, top alternatives or None) -> TokenLogprobs."""
    return [common_pb2.TokenLogprob(token_id=t, logprob=0.0 if lp is None else lp, top_logprobs=[
        common_pb2.TopLogprob(token_id=i, logprob=v) for i, v in (top or ())]) for t, lp, top in entries]


def step_batch_pb(outs: list[ReqOutput], resync: bool = False) -> detokenizer_pb2.StepBatch:
    return detokenizer_pb2.StepBatch(deltas=[output_to_pb(o) for o in outs], sent_at=time.time(), resync=resync)


def load_to_pb(ld: Load) -> scheduler_pb2.LoadReport:
    return scheduler_pb2.LoadReport(
        num_running_reqs=ld.num_running_reqs, num_queue_reqs=ld.num_queue_reqs, num_used_tokens=ld.num_used_tokens,
        max_total_num_tokens=ld.max_total_num_tokens, token_usage=ld.token_usage,
        cache_hit_rate=ld.cache_hit_rate, gen_throughput=ld.gen_throughput)


# -- the service -----------------------------------------------------------------------------------

class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, get_engine: Callable[[], Engine | None], info: Callable[[], scheduler_pb2.GetSchedulerInfoResponse],
                 load_interval_s: float) -> None:
        self._get_engine = get_engine
        self._info = info
        self.load_interval_s = load_interval_s
        self.draining = False   # refuse new requests (SIGTERM)
        self.closing = False    # end Connect streams (drain finished)

    def _engine(self) -> Engine:
        engine = self._get_engine()
        if engine is None:
            raise Unavailable("the scheduler is still loading its model")
        return engine

    async def Connect(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.ConnectResponse]:
        engine = self._engine()
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
            yield scheduler_pb2.ConnectResponse(load=load_to_pb(engine.load()))
            while True:
                try:
                    item = await asyncio.wait_for(out.get(), timeout=self.load_interval_s)
                except TimeoutError:
                    item = scheduler_pb2.ConnectResponse(load=load_to_pb(engine.load()))
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
        limit = engine.max_prompt_tokens
        for pb in msg.requests:
            if self.draining:
                rejections.append(scheduler_pb2.Rejection(rid=pb.rid, status_code=UNAVAILABLE,
                                                          message="the scheduler is shutting down"))
                continue
            if not 0 < len(pb.input_ids) <= limit:
                rejections.append(scheduler_pb2.Rejection(
                    rid=pb.rid, status_code=INVALID_ARGUMENT,
                    message=f"input_ids: {len(pb.input_ids)} tokens; must be 1 to {limit}"))
                continue
            try:
                engine.submit(req_from_pb(pb, owner))
            except QueueFull as e:
                log.info("rid=%s rejected: %s", pb.rid, e)
                rejections.append(scheduler_pb2.Rejection(rid=pb.rid, status_code=RESOURCE_EXHAUSTED, message=str(e)))
        if msg.abort_rids:
            engine.abort(list(msg.abort_rids))
        if rejections:
            await out.put(scheduler_pb2.ConnectResponse(rejections=rejections))

    async def GetLoad(self, request, context) -> scheduler_pb2.GetLoadResponse:
        return scheduler_pb2.GetLoadResponse(load=load_to_pb(self._engine().load()))

    async def GetSchedulerInfo(self, request, context) -> scheduler_pb2.GetSchedulerInfoResponse:
        self._engine()
        return self._info()

    async def FlushCache(self, request, context) -> scheduler_pb2.SchedulerServiceFlushCacheResponse:
        ok, message = await asyncio.to_thread(self._engine().flush_cache)
        return scheduler_pb2.SchedulerServiceFlushCacheResponse(success=ok, message=message)
