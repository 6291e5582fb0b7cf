"""A fake InferenceService (grpc.aio) for the gateway tests: deterministic outputs, scripted errors,
and a record of every call and every cancellation.

The prompt (text, or the last chat message) scripts the behaviour:
  "ERR <CODE> <message>"   the call fails at once with that gRPC status
  "MIDERR <CODE> <message>" two tokens are streamed, then the call fails
  "ABORT"                  the request finishes with finish_reason abort (clean, status 0)
  "SLOW"                   up to 2000 tokens, one every 20 ms (for disconnect tests)
  "EOS"                    stops after 3 tokens on EOS token id 2
anything else: max_new_tokens tokens (default 8) from WORDS, shifted by sample index and seed.
"""

from __future__ import annotations

import asyncio
import math
import threading
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ringserve.errors import ServiceError
from ringserve.v1 import api_pb2 as pb
from ringserve.v1 import api_pb2_grpc, common_pb2
from services.tokenizer.generate_session import GenerateSession
from services.tokenizer.request_state import Wakeup

WORDS = ["Hello", " world", ",", " héllo", " ✓", " the", " end", "."]
MODEL = "fake-model"
MODEL_PATH = "/models/fake"
CONTEXT = 2048


@dataclass
class Step:
    ids: list[int]
    text: str
    logprobs: list[common_pb2.TokenLogprob]


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    finish: common_pb2.FinishReason = field(default_factory=common_pb2.FinishReason)


def prompt_of(req: pb.GenerateRequest) -> tuple[str, int]:
    which = req.WhichOneof("input")
    if which == "text":
        return req.text, max(1, len(req.text.split()))
    if which == "input_ids":
        return "", len(req.input_ids.ids)
    msgs = req.chat.messages
    return (msgs[-1].content if msgs else ""), sum(max(1, len(m.content.split())) for m in msgs) + 3


def prompt_logprobs(req: pb.GenerateRequest) -> list[common_pb2.TokenLogprob]:
    """What the tokenizer returns for logprob_start_len (token-id prompts only): NaN at position 0."""
    if not (req.return_logprob and req.HasField("logprob_start_len")) or req.WhichOneof("input") != "input_ids":
        return []
    out = []
    for pos, tid in enumerate(req.input_ids.ids[req.logprob_start_len:], start=req.logprob_start_len):
        lp = common_pb2.TokenLogprob(token_id=tid, token=f"<{tid}>", logprob=math.nan if pos == 0 else -0.25 * pos)
        if pos:
            lp.top_logprobs.extend(common_pb2.TopLogprob(token_id=t, token=f"<{t}>", logprob=-0.5 * (t + 1))
                                   for t in range(req.top_logprobs_num))
        out.append(lp)
    return out


def plan_sample(req: pb.GenerateRequest, prompt: str, sample: int) -> Plan:
    sp = req.sampling_params
    limit = sp.max_new_tokens if sp.HasField("max_new_tokens") else 8
    shift = sample + (sp.seed if sp.HasField("seed") else 0)
    slow = prompt.startswith("SLOW")
    if slow:
        limit = 2000
    plan, text = Plan(), ""
    for k in range(limit):
        if prompt.startswith("EOS") and k == 3:
            plan.finish = common_pb2.FinishReason(type="stop", matched_token=2)
            return plan
        word = WORDS[(k + shift) % len(WORDS)]
        tid = 100 + (k + shift) % len(WORDS)
        lp = common_pb2.TokenLogprob(token_id=tid, logprob=-0.5 * (k % 3), token=word)
        for t in range(req.top_logprobs_num):
            alt = (k + shift + t) % len(WORDS)
            lp.top_logprobs.append(common_pb2.TopLogprob(token_id=100 + alt, logprob=-0.5 * t - 0.1,
                                                         token=WORDS[alt]))
        new_text = text + word
        hit = next((s for s in sp.stop if s and s in new_text), None)
        if hit is not None:
            cut = new_text.index(hit) + (len(hit) if sp.no_stop_trim else 0)
            plan.steps.append(Step([tid], new_text[len(text):cut], [lp] if req.return_logprob else []))
            plan.finish = common_pb2.FinishReason(type="stop", matched_str=hit)
            return plan
        plan.steps.append(Step([tid], word, [lp] if req.return_logprob else []))
        text = new_text
    plan.finish = common_pb2.FinishReason(type="length")
    return plan


def _error(code: str, message: str) -> ServiceError:
    err = ServiceError(message)
    err.code = grpc.StatusCode[code]
    return err


class _HandlerCall:
    def __init__(self, wakeup: Wakeup) -> None:
        self.wakeup = wakeup
        self.outs: list[pb.GenerateResponse] = []
        self.done = False
        self.error: ServiceError | None = None
        self.task: asyncio.Task[None] | None = None


class HandlerGenerations:
    """The tokenizer's GenerateStream session protocol (generate_session.Generations) over the
    fake's per-request output generator: a task per request buffers what it yields."""

    def __init__(self, handler) -> None:
        self.handler = handler

    async def start(self, req: pb.GenerateRequest, wakeup: Wakeup) -> _HandlerCall:
        call = _HandlerCall(wakeup)
        call.task = asyncio.ensure_future(self._run(call, self.handler(req)))
        return call

    async def _run(self, call: _HandlerCall, outputs) -> None:
        try:
            async for out in outputs:
                call.outs.append(out)
                call.wakeup.set()
        except ServiceError as e:
            call.error = e
        finally:
            await outputs.aclose()
            call.done = True
            call.wakeup.set()

    def collect(self, call: _HandlerCall, into: RepeatedCompositeFieldContainer[pb.GenerateResponse]
                ) -> tuple[bool, ServiceError | None]:
        outs, call.outs = call.outs, []
        into.extend(outs)
        return call.done, call.error

    def release(self, call: _HandlerCall) -> None:
        if call.task is not None:
            call.task.cancel()


class FakeInference(api_pb2_grpc.InferenceServiceServicer):
    def __init__(self) -> None:
        self.calls: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.cancel_event = threading.Event()
        self.aborts: list[str] = []
        self.flush_ok = True
        self.ops: list[tuple[str, str]] = []  # operation RPCs and their main argument
        self.paused = ""
        self.weight_version = "default"

    def reset(self) -> None:
        self.calls.clear()
        self.cancelled.clear()
        self.cancel_event.clear()
        self.aborts.clear()
        self.flush_ok = True
        self.ops.clear()
        self.paused = ""
        self.weight_version = "default"

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            async for msg in self._outputs(request):
                yield msg
        except ServiceError as e:
            await context.abort(e.code, e.message)

    async def GenerateStream(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802
        # The tokenizer's own session over the fake's outputs, as the real servicer wires it.
        # aclosing: a call that ends at a yield still stops its generations now, not at GC.
        async with aclosing(GenerateSession(HandlerGenerations(self._outputs)).serve(request_iterator)) as batches:
            async for batch in batches:
                yield batch

    async def _outputs(self, request: pb.GenerateRequest):
        self.calls.append(request)
        prompt, prompt_tokens = prompt_of(request)
        if prompt.startswith("ERR "):
            _, code, detail = prompt.split(" ", 2)
            raise _error(code, detail)
        n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
        rids = [request.rid] * n  # the real tokenizer names every sample by the client rid
        plans = [plan_sample(request, prompt, i) for i in range(n)]
        if prompt.startswith("ABORT"):
            for p in plans:
                p.steps = p.steps[:1]
                p.finish = common_pb2.FinishReason(type="abort", message="aborted by request")
        try:
            if request.stream:
                async for msg in self._stream(request, plans, rids, prompt, prompt_tokens):
                    yield msg
            else:
                if prompt.startswith("SLOW"):
                    await asyncio.sleep(30)  # a long non-streamed generation
                for i, p in enumerate(plans):
                    msg = pb.GenerateResponse(rid=request.rid, index=i, finished=True,
                                              text="".join(s.text for s in p.steps),
                                              input_logprobs=prompt_logprobs(request))
                    for s in p.steps:
                        msg.output_ids.extend(s.ids)
                        msg.logprobs.extend(s.logprobs)
                    msg.meta_info.CopyFrom(self._meta(rids[i], prompt_tokens, len(p.steps), p.finish))
                    yield msg
        except asyncio.CancelledError:
            self.cancelled.append(request.rid)
            self.cancel_event.set()
            raise

    async def _stream(self, request, plans, rids, prompt, prompt_tokens):
        longest = max(len(p.steps) for p in plans)
        for k in range(longest):
            if prompt.startswith("MIDERR") and k == 2:
                _, code, msg = prompt.split(" ", 2)
                raise _error(code, msg)
            if prompt.startswith("SLOW"):
                await asyncio.sleep(0.02)  # simulated decode time, not a readiness wait
            for i, p in enumerate(plans):
                if k >= len(p.steps):
                    continue
                s = p.steps[k]
                last = k == len(p.steps) - 1
                msg = pb.GenerateResponse(rid=request.rid, index=i, text=s.text, output_ids=s.ids,
                                          logprobs=s.logprobs, finished=last,
                                          input_logprobs=prompt_logprobs(request) if k == 0 else [])
                msg.meta_info.CopyFrom(self._meta(rids[i], prompt_tokens, k + 1,
                                                  p.finish if last else common_pb2.FinishReason()))
                yield msg
        for i, p in enumerate(plans):  # samples that produced nothing still finish
            if not p.steps:
                msg = pb.GenerateResponse(rid=request.rid, index=i, finished=True)
                msg.meta_info.CopyFrom(self._meta(rids[i], prompt_tokens, 0, p.finish))
                yield msg

    @staticmethod
    def _meta(rid: str, prompt_tokens: int, done: int, finish: common_pb2.FinishReason) -> pb.MetaInfo:
        meta = pb.MetaInfo(id=rid, prompt_tokens=prompt_tokens, completion_tokens=done, cached_tokens=1)
        if finish.type:
            meta.finish_reason.CopyFrom(finish)
            meta.e2e_latency = 0.01
        return meta

    async def Abort(self, request, context):  # noqa: N802
        if request.abort_all:
            self.ops.append(("AbortAll", ""))
            return pb.AbortResponse(found=True, num_aborted=3)
        self.aborts.append(request.rid)
        return pb.AbortResponse(found=request.rid == "live")

    async def PauseGeneration(self, request, context):  # noqa: N802
        self.ops.append(("PauseGeneration", request.mode))
        self.paused = request.mode
        return pb.PauseGenerationResponse(num_requests=2)

    async def ContinueGeneration(self, request, context):  # noqa: N802
        self.ops.append(("ContinueGeneration", ""))
        self.paused = ""
        return pb.ContinueGenerationResponse()

    async def UpdateWeightsFromDisk(self, request, context):  # noqa: N802
        self.ops.append(("UpdateWeightsFromDisk", request.model_path))
        if request.model_path != "/models/new":
            return pb.UpdateWeightsFromDiskResponse(success=False, weight_version=self.weight_version,
                                                    message=f"model_path: {request.model_path!r} is not a directory")
        self.weight_version = request.weight_version or request.model_path
        return pb.UpdateWeightsFromDiskResponse(success=True, message="Succeeded.", num_paused_requests=1,
                                                weight_version=self.weight_version)

    async def StartProfile(self, request, context):  # noqa: N802
        self.ops.append(("StartProfile", f"{request.output_dir}|{request.num_steps}|{','.join(request.activities)}"))
        return pb.StartProfileResponse(message="profiling")

    async def StopProfile(self, request, context):  # noqa: N802
        self.ops.append(("StopProfile", ""))
        return pb.StopProfileResponse(trace_files=["/tmp/x.pt.trace.json"])

    async def GetLoad(self, request, context):  # noqa: N802
        return pb.InferenceServiceGetLoadResponse(loads=[
            pb.SchedulerLoad(address="s0", connected=True, num_running_reqs=2, num_queue_reqs=3, num_used_tokens=40),
            pb.SchedulerLoad(address="s1", connected=True, num_running_reqs=0, num_queue_reqs=0)])

    async def GetModelInfo(self, request, context):  # noqa: N802
        return pb.GetModelInfoResponse(model_path=MODEL_PATH, served_model_name=MODEL, max_context_length=CONTEXT,
                                       vocab_size=300, eos_token_ids=[2], is_generation=True, has_chat_template=True,
                                       weight_version=self.weight_version)

    async def GetServerInfo(self, request, context):  # noqa: N802
        return pb.GetServerInfoResponse(num_running_reqs=1, tokenizer_id="tok-1", routing_policy="round_robin",
                                        version="test", paused=self.paused)

    async def FlushCache(self, request, context):  # noqa: N802
        return pb.FlushCacheResponse(success=self.flush_ok, message="" if self.flush_ok else "requests running")

    async def Detokenize(self, request, context):  # noqa: N802
        return pb.DetokenizeResponse(text="".join(f"<{i}>" for i in request.ids))


class FakeTokenizer:
    """The fake server on its own event loop in a background thread (tests stay synchronous)."""

    def __init__(self) -> None:
        self.servicer = FakeInference()
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def start(self) -> FakeTokenizer:
        self._thread.start()
        self._call(self._start())
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self._call(self.health.set("", status))

    def stop(self) -> None:
        if self._server is not None:
            self._call(self._server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
