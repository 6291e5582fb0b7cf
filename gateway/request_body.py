"""How the gateway takes a request body: as JSON whatever the Content-Type, and within a size limit.

JsonBodyMiddleware: `curl URL -d '{...}'` sends `application/x-www-form-urlencoded`; SGLang's and vLLM's
users call the native API exactly that way, and FastAPI would otherwise refuse to parse the body as
the request model. Every route here takes JSON only, so the header carries no information.

BodyLimitMiddleware: bodies over --max-body-bytes get 413, by Content-Length and while streaming in.
The declared length is checked before anything is read; a chunked or lying body is counted as it
arrives, and once it passes the limit the app's (400) answer is replaced with the 413.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError


class JsonBodyMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> GatewayError:
        return GatewayError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._error().response()(scope, receive, send)
            return
        seen = 0
        over = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:
                return  # the app's answer to a cut-off body is replaced by the 413 below
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyTooLarge:
            pass
        if over and not started:
            await self._error().response()(scope, receive, send)
