"""Rotary position embedding (HF "rotate half" layout) from a precomputed cos/sin table.

inv_freq comes from transformers' own ROPE_INIT_FUNCTIONS (llama3, yarn, linear, ...) so every scaled
variant a config names matches transformers exactly; only "default" is computed here. "dynamic" uses
its initial frequencies. "longrope" (Phi-3's, also called "su") has two sets: positions below
`original_max_position_embeddings` rotate with the short factors, positions from there on with the
long ones. transformers instead picks one set for a whole forward call by its longest position (and
recomputes the cache when a sequence crosses over); a rotation that depends only on the position
keeps cached K valid whatever sequence it was computed in, which the KV pool and the radix cache
rely on. Below the original length the two agree exactly. Models whose layer types have their own
RoPE (Gemma 3: `rope_parameters` keyed by "full_attention" / "sliding_attention") build one table
per type (`layer_type`).
"""

from __future__ import annotations

import torch

from services.scheduler.kernels.cpu_kernels import NativeKernels

Rotation = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """transformers 5 exposes `config.rope_parameters` (per layer type where the types differ); older
    configs carry rope_theta/rope_scaling."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None:
        return dict(params[layer_type])
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def compute_inv_freq(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """([rot_dim / 2] float32 inverse frequencies, attention scaling applied to cos/sin)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if layer_type is not None:
            return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
        return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = float(params.get("rope_theta", 10000.0))
    return 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)), 1.0


def position_freqs(config, head_dim: int, max_position: int,
                   layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """([P, rot_dim / 2] float32 angles of every position, attention scaling of cos/sin)."""
    inv_freq, scaling = compute_inv_freq(config, head_dim, layer_type)
    positions = torch.arange(max_position, dtype=torch.float32)[:, None]
    freqs = positions * inv_freq[None, :]
    params = rope_parameters(config, layer_type)
    if params.get("rope_type") == "longrope":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        original = int(params.get("original_max_position_embeddings")
                       or getattr(config, "original_max_position_embeddings", None) or max_position)
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=original + 1)
        long = positions >= original  # [P, 1]
        freqs = torch.where(long, positions * long_inv_freq[None, :], freqs)
    return freqs, scaling


class RotaryEmbedding:
    def __init__(self, config, head_dim: int, max_position: int, device: torch.device,
                 dtype: torch.dtype, layer_type: str | None = None) -> None:
        # Computed in float32 as transformers does, then cast to the model dtype (as HF casts cos/sin).
        freqs, scaling = position_freqs(config, head_dim, max_position, layer_type)  # [P, rot/2]
        self.rot_dim = 2 * freqs.shape[1]
        self.cos = (freqs.cos() * scaling).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * scaling).to(device=device, dtype=dtype)
        self.native: NativeKernels | None = None  # CPU float32: rotate in place, one pass (set by the runner)

    def prepare(self, positions: torch.Tensor) -> Rotation:
        """positions [T] int64 -> what every layer of the pass rotates with: cos, sin [T, 1, rot/2], or
        for the native kernel the checked positions themselves (it reads the tables by position)."""
        if self.native is not None:
            assert positions.numel() == 0 or 0 <= int(positions.min()) <= int(positions.max()) < len(self.cos)
            return positions.contiguous()
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def apply(self, x: torch.Tensor, rot: Rotation) -> torch.Tensor:
        """x: [T, heads, head_dim]; rotates the first rot_dim dims of every head (the native kernel
        in place)."""
        if self.native is not None:
            assert isinstance(rot, torch.Tensor)
            self.native.rope(x, rot, self.cos, self.sin)
            return x
        cos, sin = rot
        half = self.rot_dim // 2
        x1, x2 = x[..., :half], x[..., half:self.rot_dim]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rot_dim == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., self.rot_dim:]), dim=-1)
