"""Bootstrap shared by the three gRPC services: health, reflection, error mapping, draining.

A service builds its servicers, then calls `GrpcService.start()`; it reports NOT_SERVING until it
calls `set_serving(True)` (only when a request through it can succeed) and drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ringserve.errors import ErrorInterceptor

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Keepalive on both ends so a dead peer is noticed in seconds, not at the next TCP timeout.
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.lb_policy_name", "round_robin"),
]


def insecure_channel(target: str) -> grpc.aio.Channel:
    """An asyncio channel with keepalive and fast reconnects (`dns:///` targets balance round robin)."""
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


class GrpcService:
    """One grpc.aio server with health, reflection and the error interceptor."""

    def __init__(self, name: str, address: str, service_names: Iterable[str],
                 add_servicers: Callable[[grpc.aio.Server], None]) -> None:
        self.name = name
        self.address = address
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=SERVER_OPTIONS)
        add_servicers(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = [*service_names, ""]
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.stopping = asyncio.Event()
        self.port = 0

    async def start(self) -> int:
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise RuntimeError(f"{self.name}: cannot bind {self.address}")
        await self.server.start()
        await self.set_serving(False)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stopping.set)
            except (RuntimeError, ValueError):
                pass  # not the main thread (a service started in-process by a test): no signals

        log.info("%s gRPC listening on %s (port %d)", self.name, self.address, self.port)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for svc in self._service_names:
            await self.health.set(svc, status)

    async def drain(self, grace_s: float) -> None:
        """Stop taking new calls, let running calls finish for up to grace_s, then stop."""
        await self.set_serving(False)
        log.info("%s draining (grace %.0fs)", self.name, grace_s)
        await self.server.stop(grace_s)
        log.info("%s stopped", self.name)
