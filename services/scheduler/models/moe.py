"""The mixture-of-experts MLP shared by every MoE architecture (Mixtral, Qwen3-MoE, Qwen2-MoE).

A router scores each token against E experts; the top-k experts' SwiGLU MLPs run on it and their
outputs are summed with the router's (optionally renormalised) softmax weights. Qwen2-MoE adds a
shared expert that every token goes through, scaled by a sigmoid gate.

Expert weights are stacked: `experts.gate_up_proj` [E, 2I, H] (gate rows then up rows, the layout
transformers 5 uses in memory) and `experts.down_proj` [E, H, I]; `MoEModel` fills them from the
per-expert tensors checkpoints hold (or from the stacked tensors themselves).

Compute (`GroupedExperts.forward`): the T*k (token, expert) pairs are sorted by expert and each
active expert runs one matmul pair over its rows, so a decode step of batch 1 reads only its k
experts' weights and batch 64 reads each routed expert once (CPU float32: experts of few rows on the
C kernel `moe_gemm`, which reads each weight row once for all of them). On CUDA the same grouping runs in a
Triton grouped GEMM (`kernels/fused_moe.py`) that never syncs with the host, so decode steps of an
MoE model are captured in CUDA graphs like any other.
"""

from __future__ import annotations

import re
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.kernels.cpu_kernels import NativeKernels
from services.scheduler.models.llama import LlamaForCausalLM, LlamaMLP

# Experts with at most this many rows in a step run on the C kernel (each weight row read once, dotted
# with all of them); more rows: a BLAS GEMM per expert, which then amortises its reads.
SMALL_ROWS = 16


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k] in the model dtype
    ids: torch.Tensor      # [T, k] int64 expert ids


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> Routing:
    """Softmax over experts in float32, then top-k (as transformers does: the softmax first, so the
    unrenormalised weights are the full-softmax probabilities)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(dtype), ids)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)
        self.native: NativeKernels | None = None  # CPU float32: silu(gate) * up in one pass

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.silu_mul(gate_up)
        return F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter:]

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H]; returns sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), [T, H]."""
        if x.device.type == "cuda":  # one Triton kernel per projection, no host sync (CUDA graphs)
            from services.scheduler.kernels.fused_moe import fused_experts

            return fused_experts(x, self.gate_up_proj, self.down_proj, routing.weights, routing.ids)
        return self.grouped(x, routing)

    def grouped(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Sort the T*k pairs by expert; per expert one gate_up and one down matmul over its rows. With
        the C kernels, experts of few rows (decode) go through one moe_gemm call per projection."""
        t, k = routing.ids.shape
        flat = routing.ids.reshape(-1)                    # [T*k]
        order = torch.argsort(flat, stable=True)          # pair slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k                               # the token of each sorted pair
        xs = x.index_select(0, tokens)                    # [T*k, H]
        groups, start = [], 0
        for e, n in enumerate(counts):
            if n:
                groups.append((e, start, n))
                start += n
        small = [g for g in groups if g[2] <= SMALL_ROWS] if self.native is not None else []
        large = [g for g in groups if g[2] > SMALL_ROWS] if self.native is not None else groups
        h = xs.new_empty(xs.shape[0], 2 * self.inter)    # [T*k, 2I]
        if small:
            assert self.native is not None
            self.native.moe_gemm(xs, self.gate_up_proj, small, h)
        for e, r0, n in large:
            h[r0:r0 + n] = F.linear(xs[r0:r0 + n], self.gate_up_proj[e])
        act = self._act(h)                                # [T*k, I]
        out = torch.empty_like(xs)
        if small:
            assert self.native is not None
            self.native.moe_gemm(act, self.down_proj, small, out)
        for e, r0, n in large:
            out[r0:r0 + n] = F.linear(act[r0:r0 + n], self.down_proj[e])
        out.mul_(routing.weights.reshape(-1).index_select(0, order)[:, None])
        return torch.zeros_like(x).index_add_(0, tokens, out)


class MoEMLP(nn.Module):
    """Router (`gate`), experts, and an optional shared expert with its sigmoid gate."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool,
                 shared_inter: int = 0, shared_config=None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok: {top_k} must be in 1..{num_experts} (the number of experts)")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden, inter)
        self.shared_expert: LlamaMLP | None = None
        if shared_inter:
            self.shared_expert = LlamaMLP(shared_config, intermediate_size=shared_inter)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    @property
    def native(self) -> NativeKernels | None:
        return self.experts.native

    @native.setter
    def native(self, kernels: NativeKernels | None) -> None:
        self.experts.native = kernels
        if self.shared_expert is not None:
            self.shared_expert.native = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, route(self.gate(x), self.top_k, self.renormalize, x.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(config, layer_id: int) -> bool:
    """Qwen-MoE configs: an MoE block on every `decoder_sparse_step`-th layer, except `mlp_only_layers`."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (config.num_experts > 0 and (layer_id + 1) % step == 0
            and layer_id not in (getattr(config, "mlp_only_layers", None) or []))


_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_PART = {"gate_proj": 0, "up_proj": 1, "down_proj": 0}


class MoEModel(LlamaForCausalLM):
    """A Llama-shaped decoder whose MLPs are `MoEMLP` where the config says so (subclasses build them
    in `make_mlp` and rename their checkpoint's tensors onto ours in `hf_rename`); this class loads
    per-expert checkpoint tensors into the stacked expert parameters."""

    def weight_target(self, name: str) -> tuple[str, int | None] | None:
        m = _EXPERT.match(self.hf_rename(name.removeprefix("model.")))
        if m is None:
            return super().weight_target(name)
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        ours = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        # Shards of a stacked parameter: gate_up_proj holds 2E (expert e's gate is 2e, its up 2e+1).
        return ours, (e if proj == "down_proj" else 2 * e + _PART[proj])

    def param_shards(self, name: str) -> list[int]:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts = cast(GroupedExperts, self.get_submodule(name.rsplit(".", 1)[0])).num_experts
            return list(range(2 * experts if name.endswith("gate_up_proj") else experts))
        return super().param_shards(name)

    def shard_view(self, ours: str, shard: int, param: torch.Tensor) -> torch.Tensor:
        if ours.endswith("experts.gate_up_proj"):
            inter = param.shape[1] // 2
            e, part = divmod(shard, 2)
            return param[e, part * inter:(part + 1) * inter]
        if ours.endswith("experts.down_proj"):
            return param[shard]
        return super().shard_view(ours, shard, param)


# ---- the MoE architectures: each differs only in its MLP block and its checkpoint names ----

_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(MoEModel):
    """Mistral's attention with an MoE block in every layer (top-k always renormalised, no shared
    expert). Checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate),
    w3 (up), w2 (down)."""

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return MoEMLP(config.hidden_size, config.intermediate_size, config.num_local_experts,
                      config.num_experts_per_tok, renormalize=True)

    def hf_rename(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.", name)


class Qwen3MoeForCausalLM(MoEModel):
    """Qwen3's attention (per-head q/k norms) with MoE blocks on the layers the config makes sparse
    (every `decoder_sparse_step`-th, except `mlp_only_layers`, which keep a dense MLP of
    `intermediate_size`); top-k renormalised when `norm_topk_prob`; no shared expert."""

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return LlamaMLP(config)
        return MoEMLP(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                      config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))


class Qwen2MoeForCausalLM(MoEModel):
    """Qwen2's attention (q/k/v bias) with MoE blocks that add a shared expert, every token's, scaled
    by sigmoid(shared_expert_gate(x)); sparse layers and top-k renormalisation as Qwen3-MoE."""

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return LlamaMLP(config)
        return MoEMLP(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                      config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                      shared_inter=config.shared_expert_intermediate_size, shared_config=config)
