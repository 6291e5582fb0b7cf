"""The LoRA adapter registry: which names requests may pick, and who is using each.

The registry lives here (the tokenizer validates every request against it); the weights live in the
schedulers, and every scheduler holds the same set: a load or unload goes to all of them
(operations.py), and a scheduler that connects (or comes back after a restart) reports its adapters,
which join the registry, and is sent the ones it lacks.

Unloading: the name leaves the registry at once (a new request naming it gets NOT_FOUND), then the
unload waits for the requests already using it to finish before the schedulers free it, so no
running request loses its adapter. A request picks an adapter by `lora_path` (SGLang) or by naming
it as the `model` (vLLM lists adapters as models).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter

from ringserve.errors import DeadlineExceeded, InvalidArgument, NotFound
from ringserve.message import LoraAdapter

log = logging.getLogger(__name__)


class LoraRegistry:
    def __init__(self) -> None:
        self.adapters: dict[str, LoraAdapter] = {}
        self.ids: dict[str, int] = {}               # name -> a number unique per registration (routing keys)
        self.in_use: Counter[str] = Counter()       # name -> live requests using it (samples)
        self.loading: set[str] = set()              # names being loaded now (a second load is refused)
        self._ids = itertools.count(1)
        self._idle = asyncio.Condition()

    def listing(self) -> list[LoraAdapter]:
        return sorted(self.adapters.values(), key=lambda a: a.name)

    def add(self, adapter: LoraAdapter) -> None:
        if adapter.name not in self.adapters:
            self.ids[adapter.name] = next(self._ids)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> LoraAdapter:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise NotFound(f"lora_name: adapter {name!r} is not loaded{self._loaded()}")
        self.ids.pop(name, None)
        return adapter

    def pick(self, lora_path: str, model: str, served_model_name: str) -> str:
        """The adapter a request asks for ("" for the base model). lora_path names it (SGLang), or the
        model field does (vLLM); NOT_FOUND names an unknown one."""
        if lora_path:
            if lora_path not in self.adapters:
                raise NotFound(f"lora_path: adapter {lora_path!r} is not loaded{self._loaded()}")
            if model and model not in (served_model_name, lora_path):
                raise InvalidArgument("model", f"{model!r} does not match lora_path {lora_path!r}")
            return lora_path
        if model and model != served_model_name and model in self.adapters:
            return model
        return ""

    def route_prefix(self, name: str) -> list[int]:
        """Prepended to the prompt's ids for prefix-aware routing: KV is never shared across adapters,
        so the same prompt on two adapters must not look like a shared prefix (negative: no token)."""
        return [-self.ids[name]] if name else []

    def acquire(self, name: str, n: int) -> None:
        self.in_use[name] += n

    def release(self, name: str, n: int) -> None:
        self.in_use[name] -= n
        if self.in_use[name] <= 0:
            del self.in_use[name]
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._idle:
            self._idle.notify_all()

    async def wait_unused(self, name: str, timeout_s: float) -> None:
        """Until no live request uses `name`; DEADLINE_EXCEEDED after timeout_s."""
        async with self._idle:
            try:
                await asyncio.wait_for(self._idle.wait_for(lambda: self.in_use[name] <= 0), timeout_s)
            except TimeoutError:
                raise DeadlineExceeded(f"lora_name: {self.in_use[name]} request(s) still use adapter {name!r} "
                                       f"after {timeout_s:.0f}s; it takes no new requests, retry the unload "
                                       "later") from None

    def _loaded(self) -> str:
        return f" (loaded: {', '.join(sorted(self.adapters))})" if self.adapters else " (no adapter is loaded)"
