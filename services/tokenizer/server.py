"""Wiring of the tokenizer service: tokenizer files, manager, scheduler and detokenizer clients, gRPC.

Startup: load the tokenizer, listen (NOT_SERVING), start metrics, connect to the schedulers and
subscribe to the detokenizers. Health follows the ring: SERVING only while at least one scheduler
stream and every detokenizer subscription are up. SIGTERM: NOT_SERVING, let in-flight calls finish
for drain_grace_s, then close the streams.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from ringserve import tls
from ringserve.errors import Unavailable
from ringserve.grpc_server import GrpcService
from ringserve.message import TextDelta
from ringserve.metrics_http import start_metrics_server
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import api_pb2, api_pb2_grpc

from .config import TokenizerConfig
from .detokenizer_client import DetokenizerSubscriber
from .discovery import SchedulerDiscovery
from .operations import SchedulerOps
from .parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS, detect_tool_parser
from .routing import make_router
from .scheduler_client import SchedulerPool
from .servicer import InferenceServicer
from .tokenizer_manager import ManagerSettings, TokenizerManager
from .validation import Limits

log = logging.getLogger(__name__)

SERVICE_NAME = api_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


class TokenizerServer:
    """Everything one tokenizer replica runs; tests start it in-process, __main__ runs `serve`."""

    def __init__(self, cfg: TokenizerConfig, tokenizer: TextTokenizer | None = None) -> None:
        self.cfg = cfg
        tls.configure(cfg)  # the scheduler and detokenizer channels follow it too
        self.tokenizer = tokenizer or TextTokenizer.from_model(cfg.model, cfg.chat_template or None)
        tool_parser = (cfg.tool_call_parser or detect_tool_parser(self.tokenizer.chat_template)
                       or DEFAULT_TOOL_PARSER)
        # Some formats open a call with a special token (<|python_tag|>, [TOOL_CALLS]); their text
        # must then keep special tokens, or the parser never sees the markup.
        specials = set(self.tokenizer.token_texts(sorted(self.tokenizer.special_ids)))
        markup_special = any(m in specials for m in TOOL_PARSERS[tool_parser].markers)
        log.info("tool-call parser %s%s; reasoning parser %s", tool_parser,
                 "" if cfg.tool_call_parser else " (from the chat template)", cfg.reasoning_parser or "none")
        limits = Limits(served_model_name=cfg.served_model_name, max_n=cfg.max_n,
                        max_stop_strings=cfg.max_stop_strings, max_stop_len=cfg.max_stop_len,
                        max_top_logprobs=cfg.max_top_logprobs)
        router = make_router(cfg.routing_policy, cfg.cache_threshold, cfg.balance_abs_threshold,
                             cfg.balance_rel_threshold, cfg.prefix_tree_max_tokens)
        self.schedulers = SchedulerPool(list(cfg.scheduler), cfg.tokenizer_id,
                                        on_rejection=self._on_rejection, on_down=self._on_scheduler_down,
                                        on_change=self._update_health)
        self.discovery = SchedulerDiscovery(list(cfg.scheduler), self.schedulers.set_addresses)
        self.detokenizers = DetokenizerSubscriber(list(cfg.detokenizer), cfg.tokenizer_id,
                                                  on_deltas=self._on_deltas, on_change=self._update_health,
                                                  on_grace_expired=self._on_detokenizer_gone,
                                                  grace_s=cfg.detokenizer_grace_s)
        self.manager = TokenizerManager(
            ManagerSettings(owner=cfg.tokenizer_id, limits=limits, max_pending_requests=cfg.max_pending_requests,
                            tool_call_parser=tool_parser, tool_markup_special=markup_special,
                            reasoning_parser=cfg.reasoning_parser),
            self.tokenizer, self.schedulers, router, detokenizer_up=self.detokenizers.any_connected,
            weight_version=self.schedulers.weight_version)
        ops = SchedulerOps(self.schedulers)
        self.schedulers.on_lora_info = lambda conn, adapters: ops.sync_lora(self.manager.lora, conn, adapters)
        servicer = InferenceServicer(self.manager, self.tokenizer, cfg.model, cfg.served_model_name,
                                     cfg.routing_policy, views=lambda: self.schedulers.views(self.manager.in_flight()),
                                     detokenizer_connected=self.detokenizers.all_connected, ops=ops,
                                     architectures=self.schedulers.architectures)
        self.grpc = GrpcService("tokenizer", cfg.address, [SERVICE_NAME],
                                lambda server: api_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server),
                                tls=cfg.tls)
        servicer.stopping = self.grpc.stopping
        self._serving = False
        self._health_lock = asyncio.Lock()
        self._health_tasks: set[asyncio.Task[None]] = set()

    # Callbacks bound late so the manager exists before the clients fire them.
    def _on_rejection(self, rid: str, status: grpc.StatusCode, message: str) -> None:
        self.manager.on_rejection(rid, status, message)

    def _on_scheduler_down(self, address: str) -> None:
        self.manager.on_scheduler_down(address)

    def _on_deltas(self, deltas: list[TextDelta], hops_s: float) -> None:
        self.manager.on_deltas(deltas, hops_s)

    def _on_detokenizer_gone(self) -> None:
        self.manager.fail_all(Unavailable(f"detokenizer unavailable for more than {self.cfg.detokenizer_grace_s:.0f}s"))

    def ready(self) -> bool:
        return (not self.grpc.stopping.is_set() and self.schedulers.any_connected()
                and self.detokenizers.all_connected())

    def _update_health(self) -> None:
        task = asyncio.get_running_loop().create_task(self._apply_health())
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _apply_health(self) -> None:
        async with self._health_lock:  # serialize, and always apply the latest truth
            serving = self.ready()
            if serving != self._serving:
                self._serving = serving
                log.info("health %s", "SERVING" if serving else "NOT_SERVING")
                await self.grpc.set_serving(serving)

    async def start(self) -> int:
        port = await self.grpc.start()
        if self.cfg.metrics_port >= 0:
            start_metrics_server(self.cfg.host, self.cfg.metrics_port)
        self.schedulers.start()
        await self.discovery.start()
        self.detokenizers.start()
        log.info("tokenizer %s: model=%s served as %s, schedulers=%s, detokenizers=%s, policy=%s",
                 self.cfg.tokenizer_id, self.cfg.model, self.cfg.served_model_name, ",".join(self.cfg.scheduler),
                 ",".join(self.cfg.detokenizer), self.cfg.routing_policy)
        return port

    async def stop(self, grace_s: float = 0.0) -> None:
        self.grpc.stopping.set()
        await self.grpc.drain(grace_s)
        await self.discovery.close()
        await self.schedulers.close()
        await self.detokenizers.close()

    async def serve(self) -> None:
        await self.start()
        await self.grpc.stopping.wait()
        await self.stop(self.cfg.drain_grace_s)
