"""The gateway's own Prometheus metrics: HTTP requests by route and status, and their latency.

Its own registry (not the global one), so several apps in one process (tests) do not collide.
The route label is the route template (/v1/models/{model_id:path}), never the raw path, so that
label cardinality stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "method", "route", "status"]
        self.requests = Counter("ringserve_gateway_http_requests", "HTTP requests by route and status",
                                labels, registry=self.registry)
        self.latency = Histogram("ringserve_gateway_http_request_duration_seconds",
                                 "Time from request to the end of the response (whole stream for SSE)",
                                 ["model_name", "method", "route"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.in_flight = Gauge("ringserve_gateway_http_requests_in_flight", "Requests being served",
                               ["model_name"], registry=self.registry)


def route_label(scope: Scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, model_name: Callable[[], str]) -> None:
        self.app = app
        self.metrics = metrics
        self.model_name = model_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client sees when the app dies before answering
        model = self.model_name()
        self.metrics.in_flight.labels(model).inc()

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.metrics.in_flight.labels(model).dec()
            model = self.model_name()
            route = route_label(scope)
            self.metrics.requests.labels(model, scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(model, scope["method"], route).observe(time.perf_counter() - start)


router = APIRouter(tags=["sglang"])


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
