"""Phi-3 / Phi-4-mini: the Llama decoder as is. Its checkpoints store q/k/v as one `qkv_proj` and
gate/up as one `gate_up_proj`, the fused layout this server computes with, so they load whole
(LlamaForCausalLM.missing_weights counts a whole tensor for all its shards); its "longrope" scaling
of the 128k variants is a rotary variant (rotary.py), partial rotary (Phi-4-mini) a rope parameter."""

from __future__ import annotations

from services.scheduler.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Named for the registry and for the logs; every difference lives in the shared blocks."""
