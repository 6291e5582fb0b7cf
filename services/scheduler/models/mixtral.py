"""Mixtral: Mistral's attention with an MoE block in every layer (top-k always renormalised, no
shared expert). Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate),
w3 (up), w2 (down)."""

from __future__ import annotations

import re

from torch import nn

from services.scheduler.models.moe import MoEMLP, MoEModel

_EXPERT_PROJ = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(MoEModel):
    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return MoEMLP(config.hidden_size, config.intermediate_size, config.num_local_experts,
                      config.num_experts_per_tok, renormalize=True)

    def hf_rename(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _EXPERT_PROJ.sub(lambda m: f".experts.{m.group(1)}.{_PROJ[m.group(2)]}.", name)
