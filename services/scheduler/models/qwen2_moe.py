"""Qwen2-MoE: Qwen2's attention (q/k/v bias) with MoE blocks that add a shared expert, every token's,
scaled by sigmoid(shared_expert_gate(x)); sparse layers and top-k renormalisation as Qwen3-MoE."""

from __future__ import annotations

from torch import nn

from services.scheduler.models.llama import LlamaMLP
from services.scheduler.models.moe import MoEMLP, MoEModel, is_sparse_layer


class Qwen2MoeForCausalLM(MoEModel):
    def make_mlp(self, config, layer_id: int) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return LlamaMLP(config)
        return MoEMLP(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                      config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                      shared_inter=config.shared_expert_intermediate_size, shared_config=config)
