"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with MoE blocks on the layers the config makes
sparse (every `decoder_sparse_step`-th, except `mlp_only_layers`, which keep a dense MLP of
`intermediate_size`); top-k renormalised when `norm_topk_prob`; no shared expert."""

from __future__ import annotations

from torch import nn

from services.scheduler.models.llama import LlamaMLP
from services.scheduler.models.moe import MoEMLP, MoEModel, is_sparse_layer


class Qwen3MoeForCausalLM(MoEModel):
    def make_mlp(self, config, layer_id: int) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return LlamaMLP(config)
        return MoEMLP(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                      config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))
