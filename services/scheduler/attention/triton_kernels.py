"""Paged attention in Triton: decode (split-K) and extend (cached prefix + causal new tokens).

Both read K/V in place from the pool through `req_to_token` (no gather into a padded copy), as
SGLang's Triton backend does; the layout is this project's (memory_pool.py):
- K/V buffers: [num_slots, Hkv, D] per layer; `req_to_token[row, pos]` is the slot of position `pos`.
- Queries packed request by request: decode [B, Hq, D]; extend [T, Hq, D].

Decode runs in two stages. Stage 1 splits each request's keys into `num_splits` equal ranges (the
ranges are computed in the kernel from seq_lens, so the launch shape depends only on the batch
size, which is what a CUDA graph needs) and writes per-split partial outputs and log-sum-exps for a
whole KV-head group (GQA: the group's G query heads share one read of K/V, padded to 16 rows for
tl.dot). Stage 2 merges the splits. Extend runs one program per (request, head, block of new
tokens): first over the cached prefix through req_to_token, then over the new tokens' own K/V
(contiguous) with the causal mask.

`sliding_window` (None or <= 0: full attention): the query at position i sees keys at positions j with
i - window < j <= i (Hugging Face's convention). Both kernels skip whole tiles outside it.

Under TRITON_INTERPRET=1 (set before this module is imported) the kernels run on CPU tensors; the
tests do that (tests/scheduler/attention/).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys per tile. 64 keeps a tile of K and V for D=128 in registers/shared memory on any recent GPU.
BLOCK_N = 64
# New tokens per extend program.
BLOCK_M = 32
# tl.dot needs at least 16 rows: a KV-head group of G query heads is padded to this.
MIN_BLOCK_H = 16
DEFAULT_NUM_SPLITS = 16


def window_of(sliding_window: int | None) -> int:
    """The kernels' encoding: 0 = full attention."""
    return sliding_window if sliding_window is not None and sliding_window > 0 else 0


@triton.jit
def _decode_stage1(
    Q, K, V, req_to_token, req_pool_indices, seq_lens, Mid_O, Mid_LSE,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    scale, window, group: tl.constexpr, head_dim: tl.constexpr, num_splits: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(req_pool_indices + b)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    # The decode query sits at position seq_len - 1; with a window it sees [seq_len - window, seq_len).
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(seq_len - lo, num_splits)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < group
    mask_d = offs_d < head_dim
    heads = kv_head * group + offs_h
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype))).to(tl.float32) * scale  # [BLOCK_H, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    if end > start:  # an empty split (short request) writes nothing; stage 2 skips it the same way
        out_mask = mask_h[:, None] & mask_d[None, :]
        tl.store(Mid_O + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
                 acc / l_i[:, None], mask=out_mask)
        tl.store(Mid_LSE + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_stage2(
    Mid_O, Mid_LSE, Out, seq_lens,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    window, head_dim: tl.constexpr, num_splits: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(seq_len - lo, num_splits)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for split in range(num_splits):
        start = lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)
        if end > start:
            o = tl.load(Mid_O + b * stride_mob + head * stride_moh + split * stride_mos + offs_d,
                        mask=mask_d, other=0.0)
            lse = tl.load(Mid_LSE + b * stride_mlb + head * stride_mlh + split)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * o
            total = total * alpha + w
            m = m_new
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, (acc / total).to(Out.dtype.element_ty), mask=mask_d)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, num_splits: int = DEFAULT_NUM_SPLITS,
                     mid_o: torch.Tensor | None = None, mid_lse: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; k/v_buffer: [slots, Hkv, D]; seq_lens: [B] keys per request, the query's own
    (already in the pool) included. Returns [B, Hq, D] in q's dtype.

    mid_o [>=B, Hq, num_splits, D] / mid_lse [>=B, Hq, num_splits] float32 and `out` may be passed
    in so that a CUDA graph captures fixed addresses; otherwise they are allocated here."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    if mid_o is None or mid_lse is None:
        mid_o = torch.empty(bs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(bs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view
    block_d = triton.next_power_of_2(head_dim)
    window = window_of(sliding_window)
    _decode_stage1[(bs, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), scale, window, group=group, head_dim=head_dim, num_splits=num_splits,
        BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=BLOCK_N)
    _decode_stage2[(bs, num_heads)](
        mid_o, mid_lse, out, seq_lens, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), window, head_dim=head_dim, num_splits=num_splits,
        BLOCK_D=block_d)
    return out


@triton.jit
def _extend_kernel(
    Q, K_new, V_new, K, V, Out, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_start,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_r2t,
    scale, window, group: tl.constexpr, head_dim: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    ext_len = tl.load(extend_lens + b).to(tl.int32)
    m_start = block * BLOCK_M
    if m_start < ext_len:
        kv_head = head // group
        row = tl.load(req_pool_indices + b)
        prefix = tl.load(prefix_lens + b).to(tl.int32)
        t0 = tl.load(q_start + b)
        offs_m = m_start + tl.arange(0, BLOCK_M)  # index among this request's new tokens
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < ext_len
        mask_d = offs_d < head_dim
        q = tl.load(Q + (t0 + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        pos_q = prefix + offs_m  # absolute position of each query

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # 1) The cached prefix, through req_to_token. With a window, the block's first query sees
        #    nothing before m_start + prefix - window + 1: earlier tiles are skipped.
        lo = 0
        if window > 0:
            lo = tl.maximum(prefix + m_start - window + 1, 0)
        for start_n in range(lo, prefix, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix
            slots = tl.load(req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype))).to(tl.float32) * scale
            visible = mask_n[None, :]
            if window > 0:
                visible = visible & (offs_n[None, :] > pos_q[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen no visible key yet keeps m = -inf; shift by 0 then, so exp gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(V + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        # 2) The new tokens themselves (contiguous in K_new/V_new), causal: up to the block's last query.
        lo_new = 0
        if window > 0:
            lo_new = tl.maximum(m_start - window + 1, 0)
        hi_new = tl.minimum(m_start + BLOCK_M, ext_len)
        for start_n in range(lo_new, hi_new, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi_new
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K_new + (t0 + offs_n[:, None]) * stride_knt + kv_head * stride_knh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype))).to(tl.float32) * scale
            visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            if window > 0:
                visible = visible & (offs_n[None, :] > offs_m[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(V_new + (t0 + offs_n[:, None]) * stride_vnt + kv_head * stride_vnh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows past ext_len saw nothing; they are not stored
        tl.store(Out + (t0 + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
                 (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_buffer: torch.Tensor,
                     v_buffer: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor, q_start: torch.Tensor,
                     max_extend_len: int, scale: float, sliding_window: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] and k/v_new: [T, Hkv, D], the new tokens packed request by request (request b's
    start at q_start[b]); k/v_buffer: the pool, holding each request's prefix_lens[b] cached positions
    (read through req_to_token). Returns [T, Hq, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view
    bs = req_pool_indices.shape[0]
    grid = (bs, num_heads, triton.cdiv(max_extend_len, BLOCK_M))
    _extend_kernel[grid](
        q, k_new, v_new, k_buffer, v_buffer, out, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_start,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), scale, window_of(sliding_window), group=num_heads // num_kv_heads,
        head_dim=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(head_dim))
    return out
