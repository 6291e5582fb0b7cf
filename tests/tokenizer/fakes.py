"""Fake scheduler and detokenizer gRPC servers for the tokenizer's tests.

The fake scheduler "generates" deterministic tokens (see `fake_tokens`) and pushes one TextDelta
per token straight to the fake detokenizer, which routes it to the Subscribe stream of the
request's owner, as the real ring does. Everything the tokenizer sends is recorded in a Recorder
that test threads can wait on without sleeping.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ringserve.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

REJECT_STOP = "<<reject>>"  # a stop string that makes the fake scheduler refuse the request
FAIL_STOP = "<<fail>>"  # ... or finish it as an abort carrying INTERNAL


def fake_tokens(input_ids: list[int], n: int, seed: int | None = None) -> list[int]:
    base = sum(input_ids) + (seed or 0)
    return [100 + (base + 7 * i) % 26 for i in range(n)]


def token_text(t: int) -> str:
    return chr(ord("a") + (t - 100) % 26)


def fake_text(input_ids: list[int], n: int, seed: int | None = None) -> str:
    return "".join(token_text(t) for t in fake_tokens(input_ids, n, seed))


class Recorder:
    """Thread-safe record of what reached the fakes; `wait_for` blocks on a condition, no polling."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.requests: list[scheduler_pb2.TokenizedRequest] = []
        self.aborts: list[str] = []
        self.hellos: list[str] = []
        self.subscribes: list[str] = []

    def add(self, kind: str, item: Any) -> None:
        with self.cond:
            getattr(self, kind).append(item)
            self.cond.notify_all()

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> bool:
        with self.cond:
            return self.cond.wait_for(pred, timeout)

    def rids(self) -> list[str]:
        with self.cond:
            return [r.rid for r in self.requests]


class FakeDetokenizer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.subs: dict[str, asyncio.Queue[detokenizer_pb2.SubscribeResponse]] = {}

    async def Subscribe(self, request: detokenizer_pb2.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[detokenizer_pb2.SubscribeResponse]:
        queue: asyncio.Queue[detokenizer_pb2.SubscribeResponse] = asyncio.Queue(100_000)
        self.subs[request.owner] = queue
        self.recorder.add("subscribes", request.owner)
        try:
            yield detokenizer_pb2.SubscribeResponse()  # the handshake, as the real detokenizer
            while True:
                yield await queue.get()
        finally:
            if self.subs.get(request.owner) is queue:
                del self.subs[request.owner]

    def publish(self, owner: str, deltas: list[detokenizer_pb2.TextDelta]) -> None:
        queue = self.subs.get(owner)
        if queue is not None:
            queue.put_nowait(detokenizer_pb2.SubscribeResponse(deltas=deltas))


@dataclass
class FakeSchedulerOptions:
    step_s: float = 0.002  # simulated time per generated token
    resend_from_zero: bool = False  # after every step, also re-send everything from offset 0 (resync)
    running: set[str] = field(default_factory=set)


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, detok: FakeDetokenizer, recorder: Recorder, options: FakeSchedulerOptions) -> None:
        self.detok = detok
        self.recorder = recorder
        self.options = options
        self.aborted: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def Connect(self, request_iterator: AsyncIterator[scheduler_pb2.ConnectRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.ConnectResponse]:
        first = await request_iterator.__anext__()
        self.recorder.add("hellos", first.hello.owner)
        out: asyncio.Queue[scheduler_pb2.ConnectResponse] = asyncio.Queue(10_000)
        yield scheduler_pb2.ConnectResponse(load=scheduler_pb2.LoadReport(max_total_num_tokens=1000))

        async def read() -> None:
            async for msg in request_iterator:
                for rid in msg.abort_rids:
                    self.aborted.add(rid)
                    self.recorder.add("aborts", rid)
                for req in msg.requests:
                    self.recorder.add("requests", req)
                    if REJECT_STOP in req.sampling_params.stop:
                        out.put_nowait(scheduler_pb2.ConnectResponse(rejections=[scheduler_pb2.Rejection(
                            rid=req.rid, status_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                            message="queue full")]))
                        continue
                    task = asyncio.create_task(self.run(req))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()
            for t in list(self.tasks):
                t.cancel()

    async def run(self, req: scheduler_pb2.TokenizedRequest) -> None:
        sp = req.sampling_params
        seed = sp.seed if sp.HasField("seed") else None
        tokens = fake_tokens(list(req.input_ids), sp.max_new_tokens, seed)
        self.options.running.add(req.rid)
        try:
            for i, _t in enumerate(tokens):
                await asyncio.sleep(self.options.step_s)  # simulated forward pass
                if req.rid in self.aborted:
                    return  # like the real scheduler: no more output after an abort
                last = i == len(tokens) - 1
                if FAIL_STOP in sp.stop:
                    finish = common_pb2.FinishReason(type="abort", message="engine exploded",
                                                     status_code=grpc.StatusCode.INTERNAL.value[0])
                    self.detok.publish(req.owner, [detokenizer_pb2.TextDelta(rid=req.rid, finish=finish)])
                    return
                if req.stream:
                    self.detok.publish(req.owner, [self._delta(req, tokens, i, i + 1, last)])
                    if self.options.resend_from_zero:
                        self.detok.publish(req.owner, [self._delta(req, tokens, 0, i + 1, last)])
                elif last:
                    self.detok.publish(req.owner, [self._delta(req, tokens, 0, i + 1, last)])
        finally:
            with self.recorder.cond:  # tests wait for "no longer running" on this condition
                self.options.running.discard(req.rid)
                self.recorder.cond.notify_all()

    @staticmethod
    def _delta(req: scheduler_pb2.TokenizedRequest, tokens: list[int], start: int, end: int,
               last: bool) -> detokenizer_pb2.TextDelta:
        ids = tokens[start:end]
        d = detokenizer_pb2.TextDelta(rid=req.rid, token_offset=start, ids=ids, text_offset=start,
                                      text="".join(token_text(t) for t in ids), prompt_tokens=len(req.input_ids),
                                      cached_tokens=1)
        if req.return_logprob:
            d.logprobs.extend(common_pb2.TokenLogprob(
                token_id=t, logprob=-0.5,
                top_logprobs=[common_pb2.TopLogprob(token_id=t + k, logprob=-0.5 - k)
                              for k in range(req.top_logprobs_num)]) for t in ids)
        if req.HasField("logprob_start_len") and start == 0:  # with the first delta, and every resend
            d.input_logprobs.extend(
                common_pb2.TokenLogprob(token_id=t, logprob=math.nan if pos == 0 else -1.0, top_logprobs=[
                    common_pb2.TopLogprob(token_id=t + k, logprob=-1.0 - k) for k in range(req.top_logprobs_num)])
                for pos, t in enumerate(req.input_ids) if pos >= req.logprob_start_len)
        if last:
            d.finish.CopyFrom(common_pb2.FinishReason(type="length"))
            d.timings.CopyFrom(common_pb2.Timings(queue_s=0.001, decode_s=0.01))
        return d

    async def FlushCache(self, request: scheduler_pb2.SchedulerServiceFlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerServiceFlushCacheResponse:
        return scheduler_pb2.SchedulerServiceFlushCacheResponse(success=True)
