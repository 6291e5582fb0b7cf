"""Model classes by the `architectures` name in a HF config: the one registry of what is served.

The table names modules, not classes, so that it can be read without importing torch (the launcher
checks a model before any service starts); `get_model_class` imports the one it needs. An
architecture is a class beside the blocks it reuses (llama.py: attention, norms, MLP and the dense
variants; moe.py: the MoE block, expert loading and the MoE variants; gemma3.py, whose blocks differ;
rotary.py: the RoPE variants), one line in this table and a parity test in
tests/scheduler/test_architectures.py; README.md's list is checked against it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ringserve.model_source import ModelError

if TYPE_CHECKING:
    from services.scheduler.models.llama import LlamaForCausalLM

# architectures name -> "module:class"
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "services.scheduler.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "services.scheduler.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "services.scheduler.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "services.scheduler.models.llama:LlamaForCausalLM",
    "Gemma3ForCausalLM": "services.scheduler.models.gemma3:Gemma3ForCausalLM",
    "MixtralForCausalLM": "services.scheduler.models.moe:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "services.scheduler.models.moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "services.scheduler.models.moe:Qwen3MoeForCausalLM",
    "Phi3ForCausalLM": "services.scheduler.models.llama:Phi3ForCausalLM",
}


def supported_line() -> str:
    """The README's list of served architectures (tests/test_docs.py checks it against this table)."""
    return "Architectures served: " + ", ".join(f"`{a}`" for a in sorted(ARCHITECTURES))


def check_architectures(archs: list[str], model: str) -> str:
    """The first of `archs` this scheduler serves; ModelError (one line) when none is."""
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise ModelError(f"model '{model}' has architectures {archs or '(none in config.json)'}, which this "
                     f"server does not support; supported: {', '.join(sorted(ARCHITECTURES))}")


def get_model_class(config: Any) -> type[LlamaForCausalLM]:
    arch = check_architectures(list(getattr(config, "architectures", None) or []),
                               getattr(config, "_name_or_path", "") or "?")
    module, cls = ARCHITECTURES[arch].split(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]
