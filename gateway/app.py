"""The FastAPI app: routes, middlewares (metrics > API key > body limit), error handlers, lifespan.

The lifespan opens the one gRPC channel and asks the tokenizer for the model (waiting up to
--startup-timeout-s so that `/v1/models` works from the first request); if the tokenizer is not
there yet the gateway still starts, answers 503, and learns the model on first use.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import metrics as metrics_mod
from gateway import native_routes, openai_routes, operation_routes
from gateway.auth import ApiKeyMiddleware
from gateway.backend import Backend
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, install_handlers
from gateway.metrics import GatewayMetrics, MetricsMiddleware
from gateway.request_body import BodyLimitMiddleware, JsonBodyMiddleware
from gateway.state import GatewayState

log = logging.getLogger(__name__)


def create_app(config: GatewayConfig) -> FastAPI:
    holder: dict[str, GatewayState] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = GatewayState(config, Backend(config.tokenizer, config.tls, config.tokenizer_streams))
        holder["state"] = app.state.gateway = state
        try:
            await state.backend.model_info(wait_s=config.startup_timeout_s)
            log.info("tokenizer %s serves model %s", config.tokenizer, await state.served_name())
        except GatewayError as e:
            log.warning("tokenizer %s not answering yet (%s); serving 503 until it does",
                        config.tokenizer, e.message)
        try:
            yield
        finally:
            await state.backend.close()

    app = FastAPI(title="ringserve gateway", version="1", lifespan=lifespan,
                  description="OpenAI-compatible and SGLang-native HTTP API over the ringserve tokenizer.")
    app.state.metrics = GatewayMetrics()
    install_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(native_routes.router)
    app.include_router(operation_routes.router)
    app.include_router(metrics_mod.router)
    # add_middleware wraps: the last added runs first.
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body)
    app.add_middleware(ApiKeyMiddleware, keys=config.api_keys(), public_health=config.public_health,
                       public_metrics=config.public_metrics)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics,
                       model_name=lambda: holder["state"].model_name if "state" in holder else "")
    return app
