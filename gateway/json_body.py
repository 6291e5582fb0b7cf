"""Treat every POST body as JSON, whatever Content-Type the client sent.

`curl URL -d '{...}'` sends `application/x-www-form-urlencoded`; SGLang's and vLLM's users call
the native API exactly that way, and FastAPI would otherwise refuse to parse the body as the
request model. Every route here takes JSON only, so the header carries no information.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class JsonBodyMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
