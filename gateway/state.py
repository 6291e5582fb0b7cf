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
        """The name to answer with; 404 (OpenAI's model_not_found) for a model we do not serve. A LoRA
        adapter's name is a model too (vLLM's way): the answer then names the adapter."""
        name = await self.served_name()
        info = await self.backend.model_info()
        if requested and requested not in (name, info.served_model_name, info.model_path):
            info = await self.backend.fresh_model_info()  # adapters come and go: ask, not the cache
            if requested in {a.name for a in info.lora_adapters}:
                return requested
            raise GatewayError(404, f"The model `{requested}` does not exist.", "not_found_error",
                               param="model", code="model_not_found")
        return name

    async def lora_of(self, model: str, lora_path: str | None) -> str:
        """The adapter a request runs with: lora_path, else the model when it names an adapter."""
        if lora_path:
            return lora_path
        return "" if model == self.model_name else model


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway
