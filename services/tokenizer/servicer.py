"""InferenceService over gRPC: protobuf in (from_pb), the manager, protobuf out (to_pb). Nothing else.

Errors are ringserve.errors exceptions; the shared interceptor turns them into status codes.
A Generate call that the client cancels, or whose deadline passes, is cancelled by grpc.aio; the
manager's `finally` then aborts the request at its scheduler and drops it from rid_to_state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from ringserve import __version__
from ringserve.errors import InvalidArgument, ServiceError, Unavailable
from ringserve.message import LoraAdapter
from ringserve.text_tokenizer import ChatTemplateError, TextTokenizer
from ringserve.v1 import api_pb2, api_pb2_grpc

from .generate_session import GenerateSession
from .io_struct import ChatInput, GenerateInput
from .operations import SchedulerOps
from .request_state import Wakeup
from .routing import SchedulerView
from .tokenizer_manager import Call, TokenizerManager


class StreamGenerations:
    """The manager as a GenerateStream session sees it: protobuf in and out (generate_session.Generations)."""

    def __init__(self, manager: TokenizerManager) -> None:
        self.manager = manager

    async def start(self, req: api_pb2.GenerateRequest, wakeup: Wakeup) -> Call:
        return await self.manager.start(GenerateInput.from_pb(req), wakeup)

    def collect(self, call: Call, into: RepeatedCompositeFieldContainer[api_pb2.GenerateResponse]
                ) -> tuple[bool, ServiceError | None]:
        outs, error = self.manager.collect(call)
        for o in outs:
            o.to_pb(into.add())
        return call.done, error

    def release(self, call: Call) -> None:
        self.manager.release(call)


class InferenceServicer(api_pb2_grpc.InferenceServiceServicer):
    def __init__(self, manager: TokenizerManager, tokenizer: TextTokenizer, model_path: str,
                 served_model_name: str, routing_policy: str, views: Callable[[], list[SchedulerView]],
                 detokenizer_connected: Callable[[], bool], ops: SchedulerOps | None = None,
                 architectures: Callable[[], tuple[str, list[str]]] = lambda: ("", [])) -> None:
        self.manager = manager
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.routing_policy = routing_policy
        self.views = views
        self.detokenizer_connected = detokenizer_connected
        self.ops = ops
        self.architectures = architectures  # (served, supported), from the schedulers' info
        self.stopping: asyncio.Event | None = None  # the server's drain signal, for GenerateStream

    # aclosing below: a call cancelled (or past its deadline) while suspended at a yield closes the
    # inner generators now, not at GC, so the manager's finally aborts the request at once.
    async def Generate(self, request: api_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[api_pb2.GenerateResponse]:
        async with aclosing(self.manager.generate(GenerateInput.from_pb(request))) as outputs:
            async for out in outputs:
                yield out.to_pb()

    async def GenerateStream(self, request_iterator: AsyncIterator[api_pb2.GenerateStreamRequest],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[api_pb2.GenerateStreamResponse]:
        session = GenerateSession(StreamGenerations(self.manager), self.stopping)
        async with aclosing(session.serve(request_iterator)) as batches:
            async for batch in batches:
                yield batch

    async def Abort(self, request: api_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> api_pb2.AbortResponse:
        if not request.abort_all:
            return api_pb2.AbortResponse(found=self.manager.abort(request.rid))
        # Ours at once (also those not sent yet), then every scheduler's, whichever replica owns them.
        local = self.manager.abort_all()
        remote = await self._ops().abort_all("aborted by abort_all")
        n = max(local, remote)
        return api_pb2.AbortResponse(found=n > 0, num_aborted=n)

    def _ops(self) -> SchedulerOps:
        if self.ops is None:
            raise Unavailable("server operations are not available on this tokenizer")
        return self.ops

    async def PauseGeneration(self, request: api_pb2.PauseGenerationRequest,
                              context: grpc.aio.ServicerContext) -> api_pb2.PauseGenerationResponse:
        return api_pb2.PauseGenerationResponse(num_requests=await self._ops().pause(request.mode))

    async def ContinueGeneration(self, request: api_pb2.ContinueGenerationRequest,
                                 context: grpc.aio.ServicerContext) -> api_pb2.ContinueGenerationResponse:
        await self._ops().resume()
        return api_pb2.ContinueGenerationResponse()

    async def UpdateWeightsFromDisk(self, request: api_pb2.UpdateWeightsFromDiskRequest,
                                    context: grpc.aio.ServicerContext) -> api_pb2.UpdateWeightsFromDiskResponse:
        return await self._ops().update_weights(request)

    async def StartProfile(self, request: api_pb2.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> api_pb2.StartProfileResponse:
        return api_pb2.StartProfileResponse(message=await self._ops().start_profile(request))

    async def StopProfile(self, request: api_pb2.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> api_pb2.StopProfileResponse:
        return api_pb2.StopProfileResponse(trace_files=await self._ops().stop_profile())

    async def LoadLoraAdapter(self, request: api_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> api_pb2.LoadLoraAdapterResponse:
        adapter = LoraAdapter(request.lora_name, request.lora_path, request.pinned)
        await self._ops().load_lora(self.manager.lora, adapter, self.served_model_name)
        return api_pb2.LoadLoraAdapterResponse(loaded_adapters=[a.to_pb() for a in self.manager.lora.listing()])

    async def UnloadLoraAdapter(self, request: api_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> api_pb2.UnloadLoraAdapterResponse:
        if request.timeout_s < 0:
            raise InvalidArgument("timeout_s", "must be >= 0")
        await self._ops().unload_lora(self.manager.lora, request.lora_name, request.timeout_s)
        return api_pb2.UnloadLoraAdapterResponse(loaded_adapters=[a.to_pb() for a in self.manager.lora.listing()])

    async def GetLoad(self, request: api_pb2.InferenceServiceGetLoadRequest,
                      context: grpc.aio.ServicerContext) -> api_pb2.InferenceServiceGetLoadResponse:
        return api_pb2.InferenceServiceGetLoadResponse(loads=[v.to_pb() for v in self.views()])

    async def GetModelInfo(self, request: api_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> api_pb2.GetModelInfoResponse:
        tok = self.tokenizer
        arch, supported = self.architectures()
        return api_pb2.GetModelInfoResponse(
            architecture=arch, supported_architectures=supported,
            model_path=self.model_path, served_model_name=self.served_model_name,
            max_context_length=tok.context_length, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids,
            is_generation=True, has_chat_template=bool(tok.chat_template),
            weight_version=self.manager.weight_version(next(iter(v.address for v in self.views()), "")),
            lora_adapters=[a.to_pb() for a in self.manager.lora.listing()])

    async def GetServerInfo(self, request: api_pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> api_pb2.GetServerInfoResponse:
        views = self.views()
        return api_pb2.GetServerInfoResponse(
            num_running_reqs=sum(v.load.num_running_reqs for v in views),
            num_queue_reqs=sum(v.load.num_queue_reqs for v in views),
            token_usage=max((v.load.token_usage for v in views), default=0.0),
            rid_to_state_size=len(self.manager.rid_to_state), tokenizer_id=self.manager.owner,
            routing_policy=self.routing_policy, schedulers=[v.to_pb() for v in views],
            version=__version__, detokenizer_connected=self.detokenizer_connected(),
            paused=self.ops.paused() if self.ops is not None else "")

    async def FlushCache(self, request: api_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> api_pb2.FlushCacheResponse:
        ok, message = await self.manager.flush_cache([v.load for v in self.views()])
        return api_pb2.FlushCacheResponse(success=ok, message=message)

    async def Tokenize(self, request: api_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> api_pb2.TokenizeResponse:
        which = request.WhichOneof("input")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        if which == "chat":
            chat = ChatInput.from_pb(request.chat)
            if not chat.messages:
                raise InvalidArgument("chat.messages", "must not be empty")
            try:
                ids = self.tokenizer.encode_chat(chat.messages, chat.add_generation_prompt,
                                                 chat.continue_final_message, chat.template_tools,
                                                 chat.template_kwargs)
            except ChatTemplateError as e:
                raise InvalidArgument("chat", str(e)) from e
        elif which == "text":
            ids = self.tokenizer.encode(request.text, add_special_tokens=add_special)
        else:
            raise InvalidArgument("input", "one of text or chat is required")
        return api_pb2.TokenizeResponse(ids=ids, count=len(ids), max_model_len=self.tokenizer.context_length,
                                        tokens=self.tokenizer.token_texts(ids) if ids else [])

    async def Detokenize(self, request: api_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> api_pb2.DetokenizeResponse:
        vocab = self.tokenizer.vocab_size
        for i, t in enumerate(request.ids):
            if not (0 <= t < vocab):
                raise InvalidArgument("ids", f"id {t} at position {i} is outside [0, {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return api_pb2.DetokenizeResponse(text=self.tokenizer.decode(list(request.ids), skip_special_tokens=skip))
