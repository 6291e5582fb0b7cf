"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over packed tokens and the KV pool.

Tokens of all requests are packed as [T, hidden] for every linear layer (no padding); only attention
knows about requests, through the attention backend. The model keeps no cache of its own.
q/k/v and gate/up are fused into one matmul each at load time (fewer kernel launches per layer).
Variants: Qwen2 has q/k/v bias; Qwen3 has RMSNorm on each head of q and k (`q_norm`, `k_norm`).
A layer's attention may have a sliding window (`layer_window`): the attention backend applies it.
Other families reuse these blocks (gemma3.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.kernels.cpu_kernels import NativeKernels
from services.scheduler.kernels.cpu_linear import PackedLinear
from services.scheduler.models.rotary import RotaryEmbedding, Rotation

# model_type values whose attention has q/k/v bias (Qwen2's) or per-head q/k RMSNorm (Qwen3's).
QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}
QK_NORM_TYPES = {"qwen3", "qwen3_moe"}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.native: NativeKernels | None = None  # CPU float32: the residual add and the norm in one pass
        # With bf16 edges: the dtype the linear reading the output takes for T rows (its bound
        # input_dtype: a method, so that the linear is not registered as this norm's submodule).
        self.out_dtype: Callable[[int], torch.dtype] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta); the native kernel adds into x in place (x: the residual stream,
        which nothing else holds). delta None: no add. The native kernel writes the output in the
        dtype its linear reads (`out_dtype`)."""
        if self.native is not None:
            out = torch.float32 if self.out_dtype is None else self.out_dtype(x.shape[0])
            return self.native.add_rms_norm(x, delta, self.weight, self.eps, out), x
        if delta is not None:
            x = x + delta
        return self(x), x


def layer_window(config, layer_id: int) -> int | None:
    """The sliding window of layer `layer_id`'s attention, None for full attention: a config's
    `sliding_window` applies to every layer (Mistral), or with `layer_types` to its "sliding_attention"
    layers only (Gemma 3, Qwen2 with use_sliding_window), as in transformers."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None
    if types is not None and types[layer_id] != "sliding_attention":
        return None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.sliding_window = layer_window(config, layer_id)
        self.scaling: float | None = None  # softmax scale; None: head_dim ** -0.5
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = config.model_type in QKV_BIAS_TYPES or bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type not in QKV_BIAS_TYPES
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = config.model_type in QK_NORM_TYPES
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, rot: Rotation, attn) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        qk = rope.apply(qk, rot)  # q and k rotated in one pass: [T, Hq + Hkv, D]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        return self.o_proj(attn.forward(q, k, v, self.layer_id))


class LlamaMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.inter = intermediate_size or config.intermediate_size
        self.native: NativeKernels | None = None  # CPU float32: silu(gate) * up in one pass
        self.down_dtype: Callable[[int], torch.dtype] | None = None  # with bf16 edges: down's input_dtype
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if self.native is not None:
            out = torch.float32 if self.down_dtype is None else self.down_dtype(x.shape[0])
            return self.down_proj(self.native.silu_mul(gate_up, out))
        return self.down_proj(F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter:])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, mlp: nn.Module | None = None) -> None:
        """mlp: the layer's feed-forward block, [T, H] -> [T, H] (None: LlamaMLP; MoE models pass theirs)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rope: RotaryEmbedding, rot: Rotation,
                attn) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, H], still without `delta` (the previous layer's MLP output, None
        for the first layer), so each add goes with the norm after it. Returns (x, this MLP's output).
        csrc/decode_stack.c runs this same sequence for CPU decode steps (cpu_decode.py): a change
        here goes there too (tests/scheduler/test_cpu_decode.py compares the two bit for bit)."""
        h, x = self.input_layernorm.add_norm(x, delta)
        h, x = self.post_attention_layernorm.add_norm(x, self.self_attn(h, rope, rot, attn))
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    # HF name -> (our fused parameter, shard index); shards are stacked along dim 0 in this order.
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, self.make_mlp(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # None when tied: the logits use the embedding matrix (a CPU runner may set a packed copy here).
        self.lm_head: nn.Module | None = (None if self.tie_word_embeddings else
                                          nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.max_position = max_position
        self.rotary: RotaryEmbedding | None = None  # built by init_rotary once the model is on its device
        for p in self.parameters():
            p.requires_grad_(False)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s feed-forward block (a subclass returns an MoE block where it has one)."""
        return LlamaMLP(config)

    def init_rotary(self, device: torch.device, dtype: torch.dtype) -> None:
        self.rotary = RotaryEmbedding(self.config, self.first_attention().head_dim, self.max_position, device, dtype)

    def first_attention(self) -> LlamaAttention:
        """The first layer's attention (every layer has the same shapes)."""
        return cast(LlamaDecoderLayer, self.layers[0]).self_attn

    def sliding_windows(self) -> list[int | None]:
        """Per layer, its attention's sliding window (None: full attention), for the attention backend."""
        return [cast(LlamaDecoderLayer, layer).self_attn.sliding_window for layer in self.layers]

    def use_native_kernels(self, kernels: NativeKernels) -> None:
        """Rotary, the SiLU gate and the norms on the C kernels (float32 CPU models; the runner decides)."""
        assert self.rotary is not None
        self.rotary.native = kernels
        for m in self.modules():
            if isinstance(m, RMSNorm) and m.weight.shape[0] == self.config.hidden_size:
                m.native = kernels  # not Qwen3's per-head q/k norms: those run over views of the heads
        if getattr(self.config, "hidden_act", "silu") == "silu":
            for layer in self.layers:
                # LlamaMLP or an MoE block: each has `native`
                cast(LlamaMLP, cast(LlamaDecoderLayer, layer).mlp).native = kernels

    def use_bf16_edges(self) -> int:
        """After the linears were packed with bf16 weights (and no LoRA hooks on them): the native norms
        and SiLU gate write their linear's bf16 input, and the linears whose output only they read
        (gate_up, o_proj, down) leave it in bf16. The same bits as widening and rounding around every
        GEMM (oneDNN's output is bf16 either way), without those passes. Only where this class's
        own blocks run, with the C kernels and bias-free bf16 linears; returns how many linears
        hand over bf16 output."""
        def hand_over(m: nn.Module) -> int:
            if isinstance(m, PackedLinear) and m.weight.dtype == torch.bfloat16 and m.bias is None:
                m.out_bf16 = True
                return 1
            return 0

        edges = 0
        for layer in self.layers:
            if type(layer) is not LlamaDecoderLayer or layer.input_layernorm.native is None:
                continue
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(attn.qkv_proj, PackedLinear):
                layer.input_layernorm.out_dtype = attn.qkv_proj.input_dtype
            edges += hand_over(attn.o_proj)  # read by post_attention_layernorm's residual add only
            if type(mlp) is LlamaMLP and mlp.native is not None:
                if isinstance(mlp.gate_up_proj, PackedLinear):
                    layer.post_attention_layernorm.out_dtype = mlp.gate_up_proj.input_dtype
                if isinstance(mlp.down_proj, PackedLinear):
                    mlp.down_dtype = mlp.down_proj.input_dtype
                # read by the SiLU gate, and by the next residual add (a norm's add_norm)
                edges += hand_over(mlp.gate_up_proj) + hand_over(mlp.down_proj)
        llama = all(type(layer) is LlamaDecoderLayer for layer in self.layers)
        if llama and self.norm.native is not None and isinstance(self.lm_head, PackedLinear):
            self.norm.out_dtype = self.lm_head.input_dtype  # the logits: this class's forward, not a subclass's
        return edges

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn,
                last_index: torch.Tensor | None) -> torch.Tensor:
        """input_ids, positions: [T] int64. last_index: [B] rows of T whose logits are wanted (None: all).
        Returns logits [B, V] float32."""
        assert self.rotary is not None  # init_rotary runs when the model is loaded, before any forward
        x = self.embed_tokens(input_ids)  # [T, H], a fresh tensor: the layers add into it
        rot = self.rotary.prepare(positions)
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, self.rotary, rot, attn)
        if last_index is not None:  # [B, H]: the last add, norm and lm_head only where logits are used
            assert delta is not None  # the model has at least one layer
            x, delta = x.index_select(0, last_index), delta.index_select(0, last_index)
        return self.logits(x, delta)

    def logits(self, x: torch.Tensor, delta: torch.Tensor | None, greedy: bool = False) -> torch.Tensor:
        """The last residual add, the final norm and the lm_head: x, delta [B, H] -> logits [B, V] float32.
        greedy (ForwardBatch.greedy): [B] int64, each row's argmax, where the lm_head gives it without the logits."""
        x, _ = self.norm.add_norm(x, delta)
        if greedy and isinstance(self.lm_head, PackedLinear):
            ids = self.lm_head.argmax(x)
            if ids is not None:
                return ids
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        return logits.float()

    def hf_rename(self, name: str) -> str:
        """A checkpoint tensor's name (without "model.") in this class's naming; subclasses map theirs."""
        return name

    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        """The parameter an HF checkpoint tensor fills and its shard of a fused one (None: the whole
        parameter); None when the tensor is not loaded (rotary buffers, a tied lm_head)."""
        if "rotary_emb.inv_freq" in name:
            return None
        name = self.hf_rename(name.removeprefix("model."))
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        for hf, (ours, shard) in self._FUSED.items():
            if f".{hf}." in name:
                return name.replace(f".{hf}.", f".{ours}."), shard
        return name, None

    def param_shards(self, name: str) -> list[int]:
        """The shards a checkpoint fills parameter `name` from ([]: one tensor fills it whole)."""
        parts = name.split(".")
        return sorted({k for ours, k in self._FUSED.values() if len(parts) > 1 and ours == parts[-2]})

    def shard_view(self, ours: str, shard: int, param: torch.Tensor) -> torch.Tensor:
        """The part of `param` that shard `shard` fills (fused q/k/v and gate/up: rows along dim 0)."""
        if ours.split(".")[-2] == "gate_up_proj":  # halves; the width differs per MLP (a shared expert's)
            half = param.shape[0] // 2
            return param[shard * half:(shard + 1) * half]
        attn = self.first_attention()
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        start = sum(sizes[:shard])
        return param[start:start + sizes[shard]]

    def expected_shape(self, target: tuple[str, int | None], params: dict[str, nn.Parameter]) -> tuple[int, ...]:
        """The shape a checkpoint tensor for `target` must have (KeyError: no such parameter)."""
        ours, shard = target
        if shard is None:
            return tuple(params[ours].shape)
        return tuple(self.shard_view(ours, shard, params[ours]).shape)

    def missing_weights(self, loaded: set[tuple[str, int | None]]) -> list[str]:
        """Parameters (or fused shards) not covered by `loaded` targets; a whole tensor covers all
        shards (a checkpoint that stores q/k/v, gate/up or the experts already fused)."""
        out = []
        for n in dict(self.named_parameters()):
            if (n, None) in loaded:
                continue
            shards = self.param_shards(n)
            out += [f"{n}#{k}" for k in shards if (n, k) not in loaded] if shards else [n]
        return out

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        """weights: iterable of (HF name, tensor). Fused q/k/v and gate/up are filled shard by shard."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            target = self.weight_target(name)
            if target is None:
                continue
            ours, shard = target
            if ours not in params:
                raise KeyError(f"unexpected weight {name}")
            if shard is None:
                params[ours].data.copy_(tensor)
            else:
                self.shard_view(ours, shard, params[ours].data).copy_(tensor)
            loaded.add(target)
        missing = self.missing_weights(loaded)
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {missing[:5]}")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini: the Llama decoder as is, named for the registry and the logs. Its
    checkpoints store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, the fused layout this
    server computes with, so they load whole (`missing_weights` counts a whole tensor for all its
    shards); the 128k variants' "longrope" is a rotary variant (rotary.py), partial rotary
    (Phi-4-mini) a rope parameter."""
