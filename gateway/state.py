"""What the routes share: the config and the one backend. No request state lives here."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from gateway.backend import Backend
from gateway.config import GatewayConfig
from gateway.errors import GatewayError


@dataclass
class GatewayState:
    config: GatewayConfig
    backend: Backend
    model_name: str = ""  # known after the first GetModelInfo; used as a metrics label

    async def served_name(self) -> str:
        info = await self.backend.model_info()
        self.model_name = self.config.served_model_name or info.served_model_name or info.model_path
        return self.model_name

    async def check_model(self, requested: str | None) -> str:
        """The name to answer with; 404 (OpenAI's model_not_found) for a model we do not serve."""
        name = await self.served_name()
        info = await self.backend.model_info()
        if requested and requested not in (name, info.served_model_name, info.model_path):
            raise GatewayError(404, f"The model `{requested}` does not exist.", "not_found_error",
                               param="model", code="model_not_found")
        return name


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway
