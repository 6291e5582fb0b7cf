"""Wiring of the detokenizer service: tokenizer, core, subscriptions, gRPC, metrics, drain."""

from __future__ import annotations

import logging

from ringserve.grpc_server import GrpcService
from ringserve.metrics_http import start_metrics_server
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.detokenizer import Detokenizer
from services.detokenizer.metrics import DetokenizerMetrics
from services.detokenizer.servicer import DetokenizerServicer
from services.detokenizer.subscriptions import Subscriptions

log = logging.getLogger(__name__)
SERVICE_NAME = detokenizer_pb2.DESCRIPTOR.services_by_name["DetokenizerService"].full_name


def build_servicer(cfg: DetokenizerConfig, tokenizer: TextTokenizer,
                   metrics: DetokenizerMetrics | None = None) -> DetokenizerServicer:
    core = Detokenizer(tokenizer, max_tracked_requests=cfg.max_tracked_requests)
    on_change = metrics.subscribers.set if metrics is not None else None
    subs: Subscriptions[detokenizer_pb2.SubscribeResponse] = Subscriptions(
        queue_size=cfg.subscriber_queue, backlog_size=cfg.backlog, on_change=on_change)
    return DetokenizerServicer(core, subs, metrics)


async def serve(cfg: DetokenizerConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain and return (the process exits 0)."""
    tokenizer = TextTokenizer.from_model(cfg.model)
    metrics = DetokenizerMetrics(model_name=cfg.model) if cfg.metrics_port >= 0 else None
    servicer = build_servicer(cfg, tokenizer, metrics)
    service = GrpcService("detokenizer", cfg.address, [SERVICE_NAME],
                          lambda server: detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(
                              servicer, server), tls=cfg.tls)
    await service.start()
    start_metrics_server(cfg.host, cfg.metrics_port)
    # Nothing else to wait for: a Push or Subscribe through a listening detokenizer can succeed.
    await service.set_serving(True)
    await service.stopping.wait()
    log.info("detokenizer stopping: %d requests tracked, %d subscribers", len(servicer.core),
             len(servicer.subs))
    await service.set_serving(False)
    servicer.close()
    await service.drain(cfg.grace_s)
