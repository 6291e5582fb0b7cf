"""API keys: `Authorization: Bearer KEY` checked in constant time against every configured key.

A pure ASGI middleware (not a dependency) so that the key is checked before the body is parsed:
an unauthenticated client learns nothing about its payload, and streaming disconnects still
reach the app untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError

ALWAYS_PUBLIC = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
HEALTH_PATHS = frozenset({"/health", "/health_generate"})


def key_from_header(value: str) -> str:
    """`Bearer KEY`, or a bare key (SGLang's bench_serving sends API_KEY without the scheme)."""
    scheme, _, rest = value.strip().partition(" ")
    return rest.strip() if scheme.lower() == "bearer" else value.strip()


def key_ok(presented: str | bytes, keys: tuple[bytes, ...]) -> bool:
    """`presented` as the raw header bytes (or text); `keys` UTF-8 encoded."""
    given = presented.encode("utf-8") if isinstance(presented, str) else presented
    ok = False
    for key in keys:  # no early exit: the time taken does not say which key came close
        ok |= hmac.compare_digest(given, key)
    return ok


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...], public_health: bool, public_metrics: bool) -> None:
        self.app = app
        self.keys = tuple(k.encode("utf-8") for k in keys)
        public = set(ALWAYS_PUBLIC)
        if public_health:
            public |= HEALTH_PATHS
        if public_metrics:
            public.add("/metrics")
        self.public = frozenset(public)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        # Back to the header's raw bytes: a UTF-8 key sent as UTF-8 bytes must match its UTF-8 form
        # (decoding latin-1 and re-encoding UTF-8 would turn "ü" into four bytes and refuse it).
        if not header or not key_ok(key_from_header(header).encode("latin-1"), self.keys):
            msg = "Missing API key" if not header else "Incorrect API key provided"
            err = GatewayError(401, msg, "authentication_error", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
