"""Gemma 3 (text) decoder, from the Llama blocks (llama.py) with Gemma's differences:

- RMSNorm scales by (1 + weight): the checkpoint's weights get their 1 added once, at load, so the
  norms (and the C kernel's fused add + norm) are Llama's;
- the embeddings are scaled by sqrt(hidden_size) (in the model dtype, as transformers does);
- four norms per layer: the attention's and the MLP's outputs are normed before each joins the residual
  stream (`post_attention_layernorm`, `post_feedforward_layernorm`);
- q/k RMSNorm on each head; the softmax scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- local ("sliding_attention") and global ("full_attention") layers, each type with its own RoPE base
  (rope_parameters per layer type), the local ones with a sliding window (the attention backend's);
- a gelu(tanh) gated MLP, and the final logits soft-capped when final_logit_softcapping is set
  (None in Gemma 3's configs).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.kernels.cpu_kernels import NativeKernels
from services.scheduler.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm
from services.scheduler.models.rotary import RotaryEmbedding, Rotation

LOCAL, GLOBAL = "sliding_attention", "full_attention"


class GemmaMLP(LlamaMLP):
    """gelu(gate, tanh approximation) * up (hidden_activation gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        return self.down_proj(F.gelu(gate_up[:, : self.inter], approximate="tanh") * gate_up[:, self.inter:])


class Gemma3Attention(LlamaAttention):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.layer_type = config.layer_types[layer_id]
        self.scaling = float(config.query_pre_attn_scalar) ** -0.5
        self.qk_norm = True
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_id)
        self.mlp = GemmaMLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope: RotaryEmbedding, rot: Rotation,
                attn) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: x is the residual stream without `delta` (the previous layer's normed
        MLP output). Returns (x, this layer's normed MLP output)."""
        h, x = self.input_layernorm.add_norm(x, delta)
        h, x = self.pre_feedforward_layernorm.add_norm(x, self.post_attention_layernorm(self.self_attn(h, rope, rot,
                                                                                                         attn)))
        return x, self.post_feedforward_layernorm(self.mlp(h))


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_position: int) -> None:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            # The attention kernels have no soft-capping of scores: refuse rather than serve it wrong.
            raise ValueError(f"Gemma 3 config sets attn_logit_softcapping={config.attn_logit_softcapping}, "
                             "which this server does not implement")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 config sets use_bidirectional_attention (an embedding model), which a "
                             "causal LM server does not serve")
        super().__init__(config, max_position)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.rotary_local: RotaryEmbedding | None = None
        for p in self.parameters():
            p.requires_grad_(False)

    def init_rotary(self, device: torch.device, dtype: torch.dtype) -> None:
        head_dim = self.first_attention().head_dim
        self.rotary = RotaryEmbedding(self.config, head_dim, self.max_position, device, dtype, GLOBAL)
        self.rotary_local = RotaryEmbedding(self.config, head_dim, self.max_position, device, dtype, LOCAL)

    def use_native_kernels(self, kernels: NativeKernels) -> None:
        super().use_native_kernels(kernels)
        assert self.rotary_local is not None
        self.rotary_local.native = kernels
        for layer in self.layers:  # the gelu gate has no C kernel (the native one is SiLU's)
            cast(Gemma3DecoderLayer, layer).mlp.native = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                last_index: torch.Tensor | None) -> torch.Tensor:
        """As LlamaForCausalLM.forward. Returns logits [B, V] float32."""
        assert self.rotary is not None and self.rotary_local is not None  # init_rotary ran at load
        emb = self.embed_tokens(input_ids)  # [T, H]
        x = emb * torch.tensor(self.config.hidden_size ** 0.5, dtype=emb.dtype, device=emb.device)
        ropes = {GLOBAL: (self.rotary, self.rotary.prepare(positions)),
                 LOCAL: (self.rotary_local, self.rotary_local.prepare(positions))}
        delta = None
        for layer in self.layers:
            rope, rot = ropes[cast(Gemma3DecoderLayer, layer).self_attn.layer_type]
            x, delta = layer(x, delta, rope, rot, attn)
        if last_index is not None:
            assert delta is not None  # the model has at least one layer
            x, delta = x.index_select(0, last_index), delta.index_select(0, last_index)
        x, _ = self.norm.add_norm(x, delta)
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()  # [B, V] float32

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """Llama's loading, then 1 added to every norm's weight: Gemma scales by (1 + weight)."""
        super().load_weights(weights)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.add_(1.0)
