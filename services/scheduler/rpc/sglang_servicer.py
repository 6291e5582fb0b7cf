"""SGLang's scheduler protocol (`sglang.grpc.scheduler.SglangScheduler`), served on its own port so
SGLang's Rust gateway (smg) can drive this scheduler: it tokenizes, applies chat templates and
detokenizes itself, and sends token ids.

Generate: the request is checked and converted (sglang_convert.py), one Req per sample goes to the
engine, and the outputs come straight back on the call through a `DirectStream` (direct_sink.py),
never through the detokenizer. Abort ends the call at once (a complete with finish_reason "abort" for
each open sample). A call that goes away aborts its requests.

The RPCs smg calls at startup and in steady state (HealthCheck, GetModelInfo, GetServerInfo,
GetLoads) answer as SGLang's servicer does; FlushCache works; the rest are UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb2_grpc

import ringserve
from ringserve.errors import InvalidArgument, ServiceError, Unavailable, error_for_status
from ringserve.message import SamplingParams
from ringserve.v1 import scheduler_pb2
from services.scheduler.config import SchedulerServerConfig
from services.scheduler.core.engine import Engine
from services.scheduler.core.req import Req
from services.scheduler.rpc.direct_sink import DirectStream, OutputRouter
from services.scheduler.rpc.own_thread import in_own_thread
from services.scheduler.rpc.sglang_convert import GenerateCall, ModelFacts, chunk_pb, complete_pb

log = logging.getLogger(__name__)
SERVICE_NAME = pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
OWNER = "sglang-grpc"   # Req.owner of the requests that arrive this way
# smg waits 5 s for a HealthCheck (its default --health-check-timeout-secs); answer before that.
HEALTH_CHECK_TIMEOUT_S = 4.0
HEALTH_POLL_S = 0.25    # how often a waiting HealthCheck looks for a finished engine step
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


class Unimplemented(ServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


class SglangServicer(pb2_grpc.SglangSchedulerServicer):
    def __init__(self, get_engine: Callable[[], Engine | None], router: OutputRouter, cfg: SchedulerServerConfig,
                 info: Callable[[], scheduler_pb2.GetSchedulerInfoResponse],
                 last_step: Callable[[], float]) -> None:
        self._get_engine = get_engine
        self.router = router
        self.cfg = cfg
        self._info = info
        self._last_step = last_step       # monotonic time the engine thread last finished a step
        self._calls: dict[str, tuple[DirectStream, list[str]]] = {}  # request_id -> its stream and rids
        self._health_ids = itertools.count()
        self._model_config: dict[str, Any] | None = None
        self.started = time.time()
        self.draining = False

    def _engine(self) -> Engine:
        engine = self._get_engine()
        if engine is None:
            raise Unavailable("the scheduler is still loading its model")
        return engine

    @staticmethod
    def facts(engine: Engine) -> ModelFacts:
        return ModelFacts(vocab_size=engine.runner.vocab_size, max_seq_len=engine.max_prompt_tokens + 1)

    # -- generation --------------------------------------------------------------------------------

    async def Generate(self, request: pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb2.GenerateResponse]:
        engine = self._engine()
        if self.draining:
            raise Unavailable("the scheduler is shutting down")
        call = GenerateCall.from_pb(request, self.facts(engine))
        if call.request_id in self._calls:
            raise InvalidArgument("request_id", f"{call.request_id!r} is already running")
        stream = DirectStream(asyncio.get_running_loop())
        rids = [self.router.rid(call.request_id, i, call.n) for i in range(call.n)]
        self.router.register(rids, stream)
        self._calls[call.request_id] = (stream, rids)
        open_ = set(range(call.n))
        submitted = 0
        try:
            for req in call.reqs(rids, OWNER):
                engine.submit(req)  # QueueFull: RESOURCE_EXHAUSTED; the samples already in are aborted below
                submitted += 1
            log.info("rid=%s generate n=%d prompt_tokens=%d stream=%s", call.request_id, call.n,
                     len(call.input_ids), call.stream)
            while open_:
                got = await stream.take()
                if stream.cancelled is not None:
                    log.info("rid=%s aborted by the client: %s", call.request_id, stream.cancelled)
                    for index in sorted(open_):
                        yield pb2.GenerateResponse(request_id=call.request_id, complete=pb2.GenerateComplete(
                            finish_reason="abort", prompt_tokens=len(call.input_ids), index=index))
                    open_.clear()
                    break
                for index in sorted(got):
                    d = got[index]
                    f = d.finish
                    if f is not None and f.type == "abort" and f.status != grpc.StatusCode.OK:
                        raise error_for_status(f.status, f.message)  # e.g. a grammar that does not compile
                    if call.stream and (d.ids or d.input_logprobs or f is None):
                        yield chunk_pb(call, index, d)
                    if f is not None:
                        yield complete_pb(call, index, d)
                        open_.discard(index)
        finally:
            self.router.unregister(rids)
            self._calls.pop(call.request_id, None)
            unfinished = [rids[i] for i in sorted(open_) if i < submitted]
            if unfinished:  # the call went away (client cancel, error): free their KV now
                engine.abort(unfinished)
                log.info("rid=%s call ended; %d samples aborted", call.request_id, len(unfinished))

    async def Abort(self, request: pb2.AbortRequest, context: grpc.aio.ServicerContext) -> pb2.AbortResponse:
        entry = self._calls.get(request.request_id)
        if entry is None:
            return pb2.AbortResponse(success=False, message=f"request {request.request_id} not found")
        stream, rids = entry
        self._engine().abort(rids)
        stream.cancel(request.reason or "aborted")
        return pb2.AbortResponse(success=True, message=f"request {request.request_id} aborted")

    # -- health and information --------------------------------------------------------------------

    async def HealthCheck(self, request: pb2.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> pb2.HealthCheckResponse:
        """As SGLang: healthy when a one-token request goes through the engine, or (under load, when it
        waits in the queue) when the engine finishes a step while we wait."""
        engine = self._get_engine()
        if engine is None:
            return pb2.HealthCheckResponse(healthy=False, message="the model is still loading")
        if self.draining:
            return pb2.HealthCheckResponse(healthy=False, message="the scheduler is shutting down")
        t0 = time.monotonic()
        rid = self.router.rid(f"health-{next(self._health_ids)}", 0, 1)
        stream = DirectStream(asyncio.get_running_loop())
        self.router.register([rid], stream)
        req = Req(rid=rid, origin_input_ids=[0], params=SamplingParams(temperature=0.0, max_new_tokens=1),
                  owner=OWNER)
        try:
            try:
                engine.submit(req)
            except ServiceError:
                pass  # a full queue: the engine is busy, and the step check below decides
            while time.monotonic() - t0 < HEALTH_CHECK_TIMEOUT_S:
                try:
                    got = await asyncio.wait_for(stream.take(), HEALTH_POLL_S)
                except TimeoutError:
                    got = {}
                if any(d.finish is not None for d in got.values()) or self._last_step() > t0:
                    return pb2.HealthCheckResponse(healthy=True, message="Health check passed")
        finally:
            self.router.unregister([rid])
            if not req.finished:
                engine.abort([rid])
        log.warning("health check: no engine step in %.0fs", HEALTH_CHECK_TIMEOUT_S)
        return pb2.HealthCheckResponse(healthy=False,
                                       message=f"no engine step in {HEALTH_CHECK_TIMEOUT_S:.0f}s")

    def _config_json(self, engine: Engine) -> dict[str, Any]:
        if self._model_config is None:
            path = Path(engine.cfg.model) / "config.json"
            self._model_config = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        return self._model_config

    async def GetModelInfo(self, request: pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb2.GetModelInfoResponse:
        """smg loads its tokenizer from tokenizer_path (then model_path): the model directory, which
        holds tokenizer.json and tokenizer_config.json."""
        engine = self._engine()
        mc = self._config_json(engine)
        text = mc.get("text_config", mc)
        model_dir = str(Path(engine.cfg.model).resolve())  # smg reads the tokenizer from it

        def token_id(name: str) -> int:
            v = text.get(name, mc.get(name))
            return v if isinstance(v, int) else (v[0] if isinstance(v, list) and v else 0)

        return pb2.GetModelInfoResponse(
            model_path=model_dir, tokenizer_path=model_dir, is_generation=True,
            weight_version=engine.weight_version, served_model_name=model_dir,
            max_context_length=engine.runner.context_length, vocab_size=engine.runner.vocab_size,
            supports_vision=False, model_type=str(mc.get("model_type", "")),
            architectures=list(mc.get("architectures") or []), eos_token_ids=list(engine.runner.eos_token_ids),
            pad_token_id=token_id("pad_token_id"), bos_token_id=token_id("bos_token_id"),
            max_req_input_len=engine.max_prompt_tokens)

    async def GetServerInfo(self, request: pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb2.GetServerInfoResponse:
        engine = self._engine()
        args = Struct()
        args.update({k: v if v is None or isinstance(v, (str, int, float, bool)) else str(v)
                     for k, v in asdict(self.cfg).items()})
        info = Struct()
        info.update(MessageToDict(self._info(), preserving_proto_field_name=True))
        start = Timestamp()
        start.FromSeconds(int(self.started))
        load = engine.load()
        return pb2.GetServerInfoResponse(
            server_args=args, scheduler_info=info, active_requests=load.num_reqs, is_paused=engine.paused is not None,
            last_receive_timestamp=time.time(), uptime_seconds=time.time() - self.started,
            sglang_version=f"ringserve {ringserve.__version__}", server_type="grpc", start_time=start,
            max_total_num_tokens=engine.max_total_num_tokens)

    async def GetLoads(self, request: pb2.GetLoadsRequest, context: grpc.aio.ServicerContext) -> pb2.GetLoadsResponse:
        engine = self._engine()
        include = set(request.include) or {"all"}
        if unknown := include - LOAD_SECTIONS:
            raise InvalidArgument("include", f"unknown sections {sorted(unknown)} (known: {sorted(LOAD_SECTIONS)})")
        loads = []
        if not request.HasField("dp_rank") or request.dp_rank == 0:  # one rank: 0
            ld = engine.load()
            max_running = engine.scheduler.max_running
            load = pb2.SchedulerLoad(
                dp_rank=0, num_running_reqs=ld.num_running_reqs, num_waiting_reqs=ld.num_queue_reqs,
                num_total_reqs=ld.num_reqs, num_used_tokens=ld.num_used_tokens,
                max_total_num_tokens=ld.max_total_num_tokens, token_usage=ld.token_usage,
                gen_throughput=ld.gen_throughput, cache_hit_rate=ld.cache_hit_rate,
                utilization=ld.num_running_reqs / max_running, max_running_requests=max_running)
            if include & {"memory", "all"}:
                load.memory.CopyFrom(pb2.MemoryMetrics(
                    weight_gb=engine.runner.weights_bytes / 2**30,
                    kv_cache_gb=sum(i.used_bytes for i in engine.runner.memory_items() if i.name == "kv_pool") / 2**30,
                    token_capacity=ld.max_total_num_tokens))
            if include & {"queues", "all"}:
                load.queues.CopyFrom(pb2.QueueMetrics(waiting=ld.num_queue_reqs, grammar=len(engine.grammar)))
            loads.append(load)
        agg = pb2.AggregateMetrics()
        if loads:
            one = loads[0]
            agg = pb2.AggregateMetrics(total_running_reqs=one.num_running_reqs, total_waiting_reqs=one.num_waiting_reqs,
                                       total_reqs=one.num_total_reqs, avg_token_usage=one.token_usage,
                                       avg_throughput=one.gen_throughput, avg_utilization=one.utilization)
        return pb2.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(),
                                    version=f"ringserve {ringserve.__version__}", dp_rank_count=1, loads=loads,
                                    aggregate=agg)

    async def FlushCache(self, request: common_pb2.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common_pb2.FlushCacheResponse:
        engine = self._engine()
        if request.timeout_s > 0:
            await asyncio.to_thread(engine.wait_idle, request.timeout_s)
        ok, message = await in_own_thread(engine.flush_cache)
        return common_pb2.FlushCacheResponse(success=ok, message=message)

    # -- not served here ---------------------------------------------------------------------------

    async def Embed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unimplemented("Embed: this scheduler serves generation models only")

    async def StartProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unimplemented("StartProfile: use ringserve.v1.SchedulerService/StartProfile on the scheduler's own port")

    async def StopProfile(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unimplemented("StopProfile: use ringserve.v1.SchedulerService/StopProfile on the scheduler's own port")

    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unimplemented("GetTokenizer: read the tokenizer from GetModelInfo.tokenizer_path")

    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unimplemented("SubscribeKvEvents: this scheduler publishes no KV events (GetLoads reports its load)")

    async def LoadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unimplemented("LoadLoRAAdapter: not supported")

    async def UnloadLoRAAdapter(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unimplemented("UnloadLoRAAdapter: not supported")

    async def ListLoadedLoRAAdapters(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unimplemented("ListLoadedLoRAAdapters: not supported")
