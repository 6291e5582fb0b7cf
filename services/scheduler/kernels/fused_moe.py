"""The experts of an MoE block on CUDA: a grouped GEMM in Triton with no host sync (CUDA-graph safe).

The T*k (token, expert) pairs ("slots", slot = t * k + j) are laid out by expert, each expert's run
padded to a multiple of BLOCK_M, entirely on the device (`align`): sizes are bounded by
T*k + E*(BLOCK_M - 1), never read back to the host. One kernel then computes, per block of BLOCK_M
slots of one expert, rows of A times that expert's weight:
    gate_up[s] = x[s // k] @ W13[e].T          [T*k, 2I]
    down[s]    = act[s] @ W2[e].T * weight[s]  [T*k, H]
and the output is down.view(T, k, H).sum(1). Tested on CPU under TRITON_INTERPRET=1 against the
grouped torch path (tests/scheduler/test_fused_moe.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16


class Alignment(NamedTuple):
    slots: torch.Tensor        # [P] int32: the slot at each padded position; T*k (out of range) in padding
    block_expert: torch.Tensor  # [P / BLOCK_M] int32: each block's expert; E for blocks past the last run


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> Alignment:
    """ids: [T, k] expert of each slot. Fixed-size outputs (P = roundup(T*k + E*(block_m-1), block_m))."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)              # slots grouped by expert
    expert = flat.index_select(0, order)
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts).index_select(0, expert)
    dest = (padded_end - padded).index_select(0, expert) + rank
    total = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    slots = torch.full((total,), n, dtype=torch.int32, device=flat.device)
    slots.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, total, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)  # E past the end
    return Alignment(slots, block_expert)


@triton.jit
def _grouped_gemm(a_ptr, w_ptr, c_ptr, slots_ptr, block_expert_ptr, scale_ptr,
                  num_slots, num_experts, n_out, k_in, a_div,
                  stride_am, stride_we, stride_wn, stride_wk, stride_cm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr):
    """c[s, n] = sum_k a[s // a_div, k] * w[e, n, k] (times scale[s]) for the slots s of one block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < num_experts:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(slots_ptr + offs_m)
        valid = slot < num_slots
        row = slot // a_div
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :],
                        mask=valid[:, None] & (offs_k[None, :] < k_in), other=0.0)
            w = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=(offs_n[None, :] < n_out) & (offs_k[:, None] < k_in), other=0.0)
            acc += tl.dot(a, w)
        if SCALE:
            acc *= tl.load(scale_ptr + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(c_ptr + slot[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=valid[:, None] & (offs_n[None, :] < n_out))


def _gemm(a: torch.Tensor, w: torch.Tensor, al: Alignment, num_slots: int, a_div: int,
          scale: torch.Tensor | None) -> torch.Tensor:
    """[num_slots, N] rows of a (row slot // a_div) times w[e] ([E, N, K]) of each slot's expert."""
    num_experts, n_out, k_in = w.shape
    out = torch.empty(num_slots, n_out, dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 32
    grid = (al.block_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_gemm[grid](a, w, out, al.slots, al.block_expert, scale if scale is not None else out,
                        num_slots, num_experts, n_out, k_in, a_div,
                        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SCALE=scale is not None)
    return out


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; weights, ids: [T, k]. Returns [T, H]."""
    t, k = ids.shape
    x = x.contiguous()
    al = align(ids, gate_up.shape[0])
    h = _gemm(x, gate_up, al, t * k, a_div=k, scale=None)                 # [T*k, 2I]
    inter = h.shape[1] // 2
    act = (F.silu(h[:, :inter]) * h[:, inter:]).contiguous()              # [T*k, I]
    out = _gemm(act, down, al, t * k, a_div=1, scale=weights.reshape(-1).contiguous())  # [T*k, H]
    return out.view(t, k, -1).sum(dim=1)
