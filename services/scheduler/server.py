"""Wiring of the scheduler process: gRPC first (NOT_SERVING), then model load + warm-up, then the push
stream to the detokenizer; SERVING only while that stream is open. SIGTERM drains.

With --sglang-grpc-port, a second gRPC server serves SGLang's scheduler protocol (smg drives it);
its requests' outputs go back on their own calls (rpc/direct_sink.py), so it is SERVING once the model
is warm, detokenizer or not. With an empty --detokenizer there is no ring: the own port is SERVING too
(its information and control RPCs work) and refuses Connect."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc

from ringserve import tls
from ringserve.grpc_server import GrpcService
from ringserve.message import LoraAdapter, StepBatch, TokenDelta
from ringserve.metrics_http import start_metrics_server
from ringserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.config import SchedulerServerConfig
from services.scheduler.core.engine import Engine
from services.scheduler.grammar import GrammarMetrics
from services.scheduler.memory import MemoryBudgetError
from services.scheduler.model_executor.model_runner import kv_cache_dtype_name
from services.scheduler.models import ARCHITECTURES
from services.scheduler.rpc.direct_sink import OutputRouter
from services.scheduler.rpc.metrics import SchedulerMetrics
from services.scheduler.rpc.own_thread import in_own_thread
from services.scheduler.rpc.pusher import DetokenizerPusher
from services.scheduler.rpc.servicer import SchedulerServicer
from services.scheduler.rpc.sglang_servicer import SERVICE_NAME as SGLANG_SERVICE_NAME
from services.scheduler.rpc.sglang_servicer import SglangServicer

log = logging.getLogger(__name__)
SERVICE_NAME = "ringserve.v1.SchedulerService"
PAGE_SIZE = 1


class SchedulerServer:
    def __init__(self, cfg: SchedulerServerConfig) -> None:
        self.cfg = cfg
        self.engine: Engine | None = None
        self.metrics: SchedulerMetrics | None = None
        self.draining = False
        self._push_open = False
        self.servicer = SchedulerServicer(lambda: self.engine, self._info, cfg.load_report_interval_s)
        self.servicer.ring = bool(cfg.detokenizer)
        self.router = OutputRouter()
        self.last_step = 0.0   # monotonic time of the engine's last step (the SGLang HealthCheck reads it)
        self.sglang = SglangServicer(lambda: self.engine, self.router, cfg, self._info, lambda: self.last_step)
        self.grpc: GrpcService | None = None  # grpc.aio objects must be made inside the running loop
        self.sglang_grpc: GrpcService | None = None

    def _info(self) -> scheduler_pb2.GetSchedulerInfoResponse:
        e, c = self.engine, self.cfg
        assert e is not None
        return scheduler_pb2.GetSchedulerInfoResponse(
            model_path=c.model, device=str(e.runner.device), dtype=str(e.runner.linear_dtype).removeprefix("torch."),
            max_total_num_tokens=e.max_total_num_tokens, max_running_requests=e.scheduler.max_running,
            max_prefill_tokens=c.max_prefill_tokens, chunked_prefill_size=e.chunked_prefill_size,
            context_length=e.runner.context_length, schedule_policy=c.schedule_policy,
            max_queued_requests=c.max_queued_requests, page_size=PAGE_SIZE, weight_version=e.weight_version,
            paused=e.paused or "", attention_backend=e.runner.attention_backend,
            cuda_graph=e.runner.cuda_graph_runner is not None and e.runner.cuda_graph_runner.enabled,
            overlap_schedule=e.overlap is not None,
            lora_adapters=[LoraAdapter(a.weights.name, a.weights.path, a.pinned).to_pb()
                           for a in (e.lora.listing() if e.lora is not None else [])],
            max_loras_per_batch=e.lora.settings.max_loras_per_batch if e.lora is not None else 0,
            max_lora_rank=e.lora.settings.max_lora_rank if e.lora is not None else 0,
            architecture=e.runner.architecture, supported_architectures=sorted(ARCHITECTURES),
            kv_cache_dtype=kv_cache_dtype_name(e.runner.kv_dtype))

    async def _set_push_state(self, up: bool) -> None:
        self._push_open = up
        assert self.grpc is not None  # the pusher that calls this is started after serve() makes self.grpc
        await self.grpc.set_serving(up and self.engine is not None and not self.draining)
        log.info("health %s (push stream %s)", "SERVING" if up and not self.draining else "NOT_SERVING",
                 "open" if up else "down")

    def _on_step(self, outs: list[TokenDelta]) -> None:
        self.last_step = time.monotonic()
        if self.metrics is None:
            return
        for o in outs:
            if o.finish is not None and o.timings is not None:
                self.metrics.queue_time.observe(o.timings.queue_s)

    async def serve(self) -> int:
        cfg = self.cfg
        tls.configure(cfg)  # the push channel to the detokenizer follows it too
        start_metrics_server(cfg.host, cfg.metrics_port)
        self.grpc = GrpcService("scheduler", f"{cfg.host}:{cfg.port}", [SERVICE_NAME],
                                lambda s: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(self.servicer, s),
                                tls=cfg.tls)
        await self.grpc.start()
        if cfg.sglang_grpc_port is not None:
            # Its own signal handling off: this process has one SIGTERM handler (self.grpc's), and the
            # drain below stops both servers.
            self.sglang_grpc = GrpcService(
                "scheduler (SGLang protocol)", f"{cfg.host}:{cfg.sglang_grpc_port}", [SGLANG_SERVICE_NAME],
                lambda s: sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(self.sglang, s),
                tls=cfg.tls, handle_signals=False)
            await self.sglang_grpc.start()
        t0 = time.monotonic()
        grammar_metrics = GrammarMetrics(cfg.model)  # queue and masker update it themselves
        try:
            engine = await in_own_thread(Engine, cfg.engine, None, grammar_metrics)  # rpc/own_thread.py: why
        except MemoryBudgetError:  # __main__ prints it; the gRPC servers go down cleanly first
            await self.grpc.drain(0.0)
            if self.sglang_grpc is not None:
                await self.sglang_grpc.drain(0.0)
            raise
        log.info("model %s loaded in %.1fs; warming up", cfg.model, time.monotonic() - t0)
        await in_own_thread(engine.warmup)
        # Everything alive now (the model's modules, torch's and the libraries' objects: ~380K on the
        # default model) stays for the process's life; frozen, the collector's full passes skip it.
        # Each such pass otherwise took ~150 ms, a stall of the engine thread's Python in mid-serving.
        gc.collect()
        gc.freeze()
        log.info("warm-up done; KV pool %d tokens", engine.max_total_num_tokens)
        self.metrics = SchedulerMetrics(cfg.model, PAGE_SIZE, engine.max_total_num_tokens, engine.load,
                                        engine.stats, engine.memory_items)
        self.engine = engine
        pusher = (DetokenizerPusher(cfg.detokenizer, cfg.id, on_connect=lambda: engine.request_resync(None),
                                    on_resync=lambda owner: engine.request_resync(owner or None),
                                    on_state=self._set_push_state) if cfg.detokenizer else None)

        def send(batch: StepBatch, reconnect: bool) -> None:
            """Engine thread: each request's output to its sink (its own call, or the detokenizer)."""
            rest = self.router.route(batch)
            if pusher is not None and (rest.deltas or rest.resync):
                pusher.push(rest.to_pb(), resync=reconnect)

        stop = threading.Event()
        thread = threading.Thread(target=engine.run, name="engine", daemon=True, args=(stop, send, self._on_step))
        thread.start()
        tasks = [asyncio.create_task(pusher.run())] if pusher is not None else []
        if pusher is None:
            await self.grpc.set_serving(True)
            log.info("health SERVING (no detokenizer: SGLang-protocol port only)")
        if self.sglang_grpc is not None:
            await self.sglang_grpc.set_serving(True)
            log.info("SGLang-protocol port %d SERVING", self.sglang_grpc.port)
        await self.grpc.stopping.wait()

        # Drain: refuse new requests, let running ones finish (up to the grace period), then stop.
        log.info("SIGTERM: draining (grace %.0fs, %d requests in flight)", cfg.grace_period_s,
                 engine.load().num_running_reqs + engine.load().num_queue_reqs)
        self.draining = self.servicer.draining = self.sglang.draining = True
        await self.grpc.set_serving(False)
        if self.sglang_grpc is not None:
            await self.sglang_grpc.set_serving(False)
        deadline = time.monotonic() + cfg.grace_period_s
        while engine.busy() and time.monotonic() < deadline:
            await asyncio.to_thread(engine.wait_idle, min(1.0, max(0.0, deadline - time.monotonic())))
        stop.set()
        engine.wake()
        await asyncio.to_thread(thread.join, 10.0)
        self.servicer.closing = True  # Connect streams end cleanly (OK) at their next wake-up
        if pusher is not None:
            await pusher.flush_and_stop()
            await asyncio.wait({tasks[0]}, timeout=5.0)  # the push stream delivers the last batches
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.sglang_grpc is not None:
            await self.sglang_grpc.drain(1.0)  # Generate calls got their last outputs before the engine stopped
        await self.grpc.drain(cfg.load_report_interval_s + 1.0)
        log.info("scheduler stopped")
        return 0
