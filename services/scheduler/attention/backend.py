"""Attention over the KV pool with torch SDPA (CPU and CUDA).

Per forward pass, `init_forward_metadata` builds what every layer shares: the padded gather index of
each request's KV slots and the mask. Each layer then writes its new K/V at `out_cache_loc` and
attends over `req_to_token[row, :seq_len]`:

- DECODE: one batched SDPA call. Queries of a KV head's group are laid out as that head's G "query
  positions" ([B, Hkv, G, D]), so grouped-query attention needs no repeat of K/V.
- EXTEND: queries padded to the longest new span ([B, Hq, Lq, D]) with a causal-after-prefix mask;
  a single request without a cached prefix skips the pool gather and uses `is_causal`.

On CPU in float32 the C kernels (cpu_kernels.py) take over: DECODE over the dense decode cache, and
EXTEND over each request's keys read from the pool, with no padding and no mask (`extend_layout`).
Under bf16 linears (`prefill_dtype` bfloat16), an EXTEND whose requests have nothing cached runs
torch's flash attention in bf16 instead, one call per request on its new K/V (the C kernel computes
in float32; a Xeon with AMX: 71 against 187 ms for a 512-token prompt's 30 layers, 1.5x at 32 x 128).

Sliding window: a layer may attend only to the last `window` keys of each query (HF: query at
position i sees keys j with i - window < j <= i), given per layer at construction (`sliding_windows`,
from the model). The masks gain one variant per distinct window (`window_masks`), the C kernels take
the window as an argument. The KV pool still holds every token: see docs/models.md on why tokens
outside every layer's window are not freed.

The metadata tensors may be static buffers owned by the CUDA graph runner (see cuda_graph.py): the
layer code only reads `self.metadata`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.scheduler.attention.decode_cache import DecodeRows, DenseDecodeCache
from services.scheduler.kernels.cpu_kernels import (
    DecodeLayout,
    ExtendLayout,
    NativeKernels,
    extend_layout,
)
from services.scheduler.kvcache.memory_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class SDPAMetadata:
    is_decode: bool
    out_cache_loc: torch.Tensor              # [T] int64 slots the new K/V go to
    kv_index: torch.Tensor | None            # [B, Lkv] int64 slots to gather; None: attend to new K/V only
    # DECODE [B, 1, 1, Lkv] / EXTEND [B, 1, Lq, Lkv] additive mask in the KV dtype: 0 = attend, -inf = not.
    # Additive, not bool: CPU SDPA is ~1.6x faster with a float mask (measured, B=32, Lkv=210).
    mask: torch.Tensor | None
    # The same mask narrowed to each sliding window the model's layers use (window -> mask; also for the
    # one-request EXTEND that otherwise needs none). Empty when no layer has a window.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    q_pad_index: torch.Tensor | None = None  # EXTEND [T] int64: row of each token in the [B * Lq] padding
    extend_layout: ExtendLayout | None = None  # EXTEND on the C kernel (CPU): where each request's tokens are
    # EXTEND with nothing cached under bf16 linears, on a CPU without AMX tiles: each request's [start, end)
    # among the new tokens, for flash attention in bf16 (layers with a window still take the C kernel).
    prefill_spans: list[tuple[int, int]] | None = None
    batch_size: int = 0
    q_len: int = 1                           # Lq: longest new span
    dense_rows: DecodeRows | None = None     # DECODE on CPU: the batch's rows in the dense decode cache
    layout: DecodeLayout | None = None       # ... and as the C kernels read them
    # A mixed step (ForwardBatch.mix): the prefill part's and the decode part's metadata, and where the
    # decode tokens start in [T].
    parts: tuple[SDPAMetadata, SDPAMetadata, int] | None = None


class TorchSDPABackend:
    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool,
                 num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None,
                 native: NativeKernels | None = None, decode_cache_bytes: int | None = None,
                 sliding_windows: Sequence[int | None] | None = None, dtype: torch.dtype | None = None,
                 prefill_dtype: torch.dtype | None = None) -> None:
        """sliding_windows: per layer, its window (None: the layer attends to every key); None: no layer has one.
        dtype: the queries' and outputs' (None: the KV pool's); with the C kernels the pool may hold
        bfloat16 under float32 activations, and the torch paths widen what they gather.
        prefill_dtype: bfloat16 (with the C kernels): prompts with nothing cached attend in bf16."""
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.device = kv_pool.device
        self.dtype = dtype or kv_pool.dtype
        num_layers = len(kv_pool.k_buffer)
        self.windows: list[int | None] = list(sliding_windows) if sliding_windows is not None else [None] * num_layers
        if len(self.windows) != num_layers or any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"sliding_windows: one window (>= 1, or None) per layer, {num_layers} layers; "
                             f"got {self.windows}")
        self.distinct_windows = sorted({w for w in self.windows if w is not None})
        # None until the first init_forward_metadata (or graph capture), which always runs before any layer's
        # forward; typed as set so the per-layer reads need no check. It must exist from here on:
        # CudaGraphRunner looks for the attribute with hasattr.
        self.metadata: SDPAMetadata = None  # type: ignore[assignment]
        self.native = native  # CPU float32: the C kernels (decode over the dense cache, and prefill)
        self.prefill_bf16 = native is not None and prefill_dtype == torch.bfloat16
        # bf16 compute (bf16 linears) on a CPU with AMX: shared prefixes and every prefill attend by bf16
        # tile products; under float32 linears the attention arithmetic stays float32, whatever the KV
        # cache holds.
        self.tiles = self.prefill_bf16 and native is not None and native.tiles_for(kv_pool.dtype, head_dim)
        # CPU only: on CUDA the gather is cheap and the graph runner owns the decode metadata.
        self.dense = (DenseDecodeCache(kv_pool, self.req_to_token, len(kv_pool.k_buffer),
                                       self.req_to_token.shape[1], max_bytes=decode_cache_bytes,
                                       native=native, tiles=self.tiles)
                      if self.device.type == "cpu" else None)

    # ---- per forward pass ----

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.num_decode:
            extend, decode, t = batch.split()
            ext_md = self._metadata(extend)  # first: it drops the prefill requests' dense rows
            self.metadata = SDPAMetadata(is_decode=False, out_cache_loc=batch.out_cache_loc, kv_index=None,
                                         mask=None, batch_size=batch.batch_size,
                                         parts=(ext_md, self._metadata(decode), t))
            return
        self.metadata = self._metadata(batch)

    def _metadata(self, batch: ForwardBatch) -> SDPAMetadata:
        bs = batch.batch_size
        kv_len = max(batch.seq_lens_cpu)
        if batch.mode == ForwardMode.DECODE:
            rows = (self.dense.prepare(batch.req_pool_indices.tolist(), batch.seq_lens_cpu)
                    if self.dense is not None else None)
            if rows is not None and self.native is not None:  # the C kernel reads each row's own length
                assert self.dense is not None
                return SDPAMetadata(is_decode=True, out_cache_loc=batch.out_cache_loc, kv_index=None, mask=None,
                                    batch_size=bs, dense_rows=rows,
                                    layout=self.dense.layout(rows, batch.out_cache_loc))
            if rows is not None:
                return SDPAMetadata(is_decode=True, out_cache_loc=batch.out_cache_loc, kv_index=None,
                                    mask=decode_mask(rows.seq_lens_rows, rows.kv_len, self.dtype),
                                    window_masks={w: decode_mask(rows.seq_lens_rows, rows.kv_len,
                                                                 self.dtype, w)
                                                  for w in self.distinct_windows},
                                    batch_size=bs, dense_rows=rows)
            return SDPAMetadata(
                is_decode=True, out_cache_loc=batch.out_cache_loc,
                kv_index=self.req_to_token[batch.req_pool_indices, :kv_len],
                mask=decode_mask(batch.seq_lens, kv_len, self.dtype),
                window_masks={w: decode_mask(batch.seq_lens, kv_len, self.dtype, w)
                              for w in self.distinct_windows}, batch_size=bs)
        if self.dense is not None:
            self.dense.invalidate(batch.req_pool_indices.tolist())
        kv_index = self.req_to_token[batch.req_pool_indices, :kv_len]
        if self.native is not None:
            # No padding and no mask: the kernel knows where each request's tokens start and end.
            q_start = torch.zeros(bs + 1, dtype=torch.int64)
            torch.cumsum(torch.tensor(batch.extend_lens, dtype=torch.int64), 0, out=q_start[1:])
            layout = extend_layout(kv_index, q_start, torch.tensor(batch.prefix_lens, dtype=torch.int64),
                                   self.kv_pool.num_slots)
            spans = None
            # Prompts with nothing cached: flash attention in bf16 per request (SDPA, as transformers runs a
            # bf16 model), except on AMX tiles, where the C kernel is faster (in process, SmolLM2-135M, a
            # whole prefill step: 8 x 256 tokens 312 against 410 ms, 1 x 2,048 541 against 558, 1 x 512 122
            # against 129, 1 x 128 even).
            if self.prefill_bf16 and not any(batch.prefix_lens) and not self.tiles:
                bounds = q_start.tolist()
                spans = list(zip(bounds[:-1], bounds[1:]))
            return SDPAMetadata(is_decode=False, out_cache_loc=batch.out_cache_loc, kv_index=kv_index,
                                mask=None, batch_size=bs, q_len=max(batch.extend_lens), extend_layout=layout,
                                prefill_spans=spans)
        if bs == 1 and batch.prefix_lens[0] == 0:
            n = batch.extend_lens[0]
            windows: dict[int, torch.Tensor] = {}
            if self.distinct_windows:  # causal within each window: [1, 1, n, n]
                i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
                windows = {w: additive(((j <= i) & (j > i - w))[None, None].to(self.device), self.dtype)
                           for w in self.distinct_windows}
            return SDPAMetadata(is_decode=False, out_cache_loc=batch.out_cache_loc, kv_index=None,
                                mask=None, batch_size=1, q_len=n, window_masks=windows)
        q_len = max(batch.extend_lens)
        # Token t of request b sits at row b * Lq + i of the padded queries (built on CPU: lists are there).
        pad = [b * q_len + i for b, n in enumerate(batch.extend_lens) for i in range(n)]
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        seq = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64)
        i = torch.arange(q_len)[None, :, None]          # [1, Lq, 1]
        j = torch.arange(kv_len)[None, None, :]         # [1, 1, Lkv]
        # Query i of request b sees keys up to its own position (prefix + i) and never past seq_len, so
        # padded queries (i >= extend_len) still see >= 1 key and SDPA gives no NaN rows.
        mask = (j <= prefix[:, None, None] + i) & (j < seq[:, None, None])  # [B, Lq, Lkv]
        # With a window, also j > position - window; a padded query (position past seq_len - 1) still
        # sees key seq_len - 1 when the window is >= 1, so no row is empty.
        window_masks: dict[int, torch.Tensor] = {}
        if self.distinct_windows:
            pos = torch.minimum(prefix[:, None, None] + i, seq[:, None, None] - 1)
            window_masks = {w: additive((mask & (j > pos - w))[:, None].to(self.device, non_blocking=True),
                                        self.dtype) for w in self.distinct_windows}
        return SDPAMetadata(
            is_decode=False, out_cache_loc=batch.out_cache_loc, kv_index=kv_index,
            mask=additive(mask[:, None].to(self.device, non_blocking=True), self.dtype),
            window_masks=window_masks,
            q_pad_index=torch.tensor(pad, dtype=torch.int64).to(self.device, non_blocking=True),
            batch_size=bs, q_len=q_len)

    # ---- per layer ----

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq * D]."""
        md = self.metadata
        if md.layout is not None:  # a decode step on the C kernels: pool and dense rows written in one pass
            return self._decode_native(q, k, v, layer_id, md, write_pool=True)
        self._store(layer_id, md.out_cache_loc, k, v)
        if md.parts is not None:
            ext_md, dec_md, t = md.parts
            return torch.cat([self._attend(q[:t], k[:t], v[:t], layer_id, ext_md),
                              self._attend(q[t:], k[t:], v[t:], layer_id, dec_md)])
        return self._attend(q, k, v, layer_id, md)

    def _store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's new K/V into the pool: with the C kernels one parallel pass (k and v as views of
        the qkv rows), else the pool's own conversion and index_copy_."""
        if self.native is not None and k.dtype == torch.float32:
            kb, vb = self.kv_pool.get_kv_buffer(layer_id)
            self.native.store_kv(kb, vb, loc, k, v)
        else:
            self.kv_pool.set_kv_buffer(layer_id, loc, k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                md: SDPAMetadata) -> torch.Tensor:
        if md.layout is not None:  # the decode part of a mixed step: the pool is written
            return self._decode_native(q, k, v, layer_id, md, write_pool=False)
        if md.dense_rows is not None:
            return self._decode_dense(q, k, v, layer_id, md)
        if md.is_decode:
            return self._decode(q, layer_id, md)
        if md.prefill_spans is not None and self.windows[layer_id] is None:
            return self._prefill_bf16(q, k, v, md.prefill_spans)
        if md.kv_index is None:
            # One request, nothing cached: attend to the new K/V directly (causal, or the window's mask).
            window = self.windows[layer_id]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=None if window is None else md.window_masks[window], is_causal=window is None,
                scale=self.scaling, enable_gqa=self.group > 1)  # [1, Hq, T, D]
            return out[0].transpose(0, 1).reshape(q.shape[0], -1)
        return self._extend(q, layer_id, md)

    def _mask(self, md: SDPAMetadata, layer_id: int) -> torch.Tensor | None:
        """The layer's mask: the metadata's own, or its window's."""
        window = self.windows[layer_id]
        return md.mask if window is None else md.window_masks[window]

    def _gather_kv(self, layer_id: int, kv_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs, kv_len = kv_index.shape
        kb, vb = self.kv_pool.get_kv_buffer(layer_id)
        flat = kv_index.reshape(-1)
        shape = (bs, kv_len, self.num_kv_heads, self.head_dim)
        k = kb.index_select(0, flat).view(shape).transpose(1, 2).to(self.dtype)  # [B, Hkv, Lkv, D]
        v = vb.index_select(0, flat).view(shape).transpose(1, 2).to(self.dtype)
        return k, v

    def _decode(self, q: torch.Tensor, layer_id: int, md: SDPAMetadata) -> torch.Tensor:
        bs = q.shape[0]
        # Decode metadata always has a kv_index; not asserted here, as this runs per layer per token.
        k, v = self._gather_kv(layer_id, md.kv_index)  # type: ignore[arg-type]
        q = q.view(bs, self.num_kv_heads, self.group, self.head_dim)  # [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=self._mask(md, layer_id),
                                             scale=self.scaling)
        return out.reshape(bs, -1)  # [B, Hq * D]

    def _decode_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, md: SDPAMetadata,
                       write_pool: bool) -> torch.Tensor:
        # One pass over each row's own keys (no padding, no mask, no gather into row order): ~2x the
        # matmul pair of the torch path. The new K/V are written (dense row and, unless a mixed step's
        # pool write already did, the pool) by the same call, each row just before it is read.
        assert self.dense is not None and self.native is not None and md.layout is not None
        bs = q.shape[0]
        k_buf, v_buf = self.dense.buffers(layer_id)
        scale = self.scaling if self.scaling is not None else self.head_dim ** -0.5
        out = self.native.decode_attention(q.view(bs, self.num_kv_heads, self.group, self.head_dim), k_buf, v_buf,
                                           md.layout, scale, self.dense.prefix_buffers(layer_id),
                                           window=self.windows[layer_id], new_kv=(k, v),
                                           pool=self.kv_pool.get_kv_buffer(layer_id) if write_pool else None)
        return out.view(bs, -1)  # [B, Hq * D]

    def _decode_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                      md: SDPAMetadata) -> torch.Tensor:
        rows, bs = md.dense_rows, q.shape[0]
        assert self.dense is not None and rows is not None and md.mask is not None
        self.dense.write(layer_id, rows, k, v)
        q_rows = q.view(bs, self.num_kv_heads, self.group, self.head_dim)[rows.inv]  # [B, Hkv, G, D]
        scale = self.scaling if self.scaling is not None else self.head_dim ** -0.5
        k_t, v_all = self.dense.kv(layer_id, rows)  # K^T [B, Hkv, D, L], V [B, Hkv, L, D], row order
        # Plain matmuls, not SDPA: with one query per head and strided K/V rows, CPU SDPA's flash
        # kernel is about 2x slower (measured 1.28 vs 0.65 ms per layer at B=64, L=300).
        mask = self._mask(md, layer_id)
        assert mask is not None  # dense-row metadata always has its masks
        scores = torch.matmul(q_rows.to(k_t.dtype), k_t).mul_(scale).add_(mask)
        out = torch.matmul(scores.softmax(-1), v_all)  # [B, Hkv, G, D]
        return out[rows.rows].reshape(bs, -1)  # back to batch order, [B, Hq * D]

    def _extend(self, q: torch.Tensor, layer_id: int, md: SDPAMetadata) -> torch.Tensor:
        if self.native is not None:
            return self._extend_native(q, layer_id, md)
        bs, q_len = md.batch_size, md.q_len
        assert md.kv_index is not None  # _attend sends the kv_index=None case to SDPA directly
        k, v = self._gather_kv(layer_id, md.kv_index)
        q_pad = q.new_zeros(bs * q_len, self.num_heads, self.head_dim)
        q_pad[md.q_pad_index] = q
        q_pad = q_pad.view(bs, q_len, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, Lq, D]
        out = F.scaled_dot_product_attention(q_pad.to(k.dtype), k, v, attn_mask=self._mask(md, layer_id),
                                             scale=self.scaling,
                                             enable_gqa=self.group > 1)  # [B, Hq, Lq, D]
        out = out.transpose(1, 2).reshape(bs * q_len, -1)
        return out[md.q_pad_index]  # [T, Hq * D]

    def _prefill_bf16(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      spans: list[tuple[int, int]]) -> torch.Tensor:
        """Causal attention of each request's new tokens among themselves (nothing cached), in bf16 as
        transformers runs a bf16 model: q [T, Hq, D], k, v [T, Hkv, D] float32 -> [T, Hq * D] float32.
        One call per request, not one padded batch: no padding to compute, and per request the call
        was as fast (32 x 128 tokens)."""
        qb, kb, vb = (x.to(torch.bfloat16).transpose(0, 1) for x in (q, k, v))  # [H, T, D] views
        outs = [F.scaled_dot_product_attention(qb[None, :, s:e], kb[None, :, s:e], vb[None, :, s:e],
                                               is_causal=True, scale=self.scaling,
                                               enable_gqa=self.group > 1)[0]  # [Hq, n, D]
                for s, e in spans]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [Hq, T, D]
        return out.transpose(0, 1).reshape(q.shape[0], -1).float()

    def _extend_native(self, q: torch.Tensor, layer_id: int, md: SDPAMetadata) -> torch.Tensor:
        # Causal blocks are skipped, and each request's K/V are read from the pool into a per-thread
        # tile that stays in cache while all its queries read them: ~3x the padded, masked SDPA call
        # (64 x 256 tokens, one layer: 20 against 48+ ms on two threads), and no gathered copy of the
        # batch's K/V (a quarter of a prefill step after a long shared prefix).
        assert md.extend_layout is not None and self.native is not None
        t = q.shape[0]
        kb, vb = self.kv_pool.get_kv_buffer(layer_id)
        scale = self.scaling if self.scaling is not None else self.head_dim ** -0.5
        q_groups = q.reshape(t, self.num_kv_heads, self.group, self.head_dim)  # a view: the kernel takes q's row stride
        out = self.native.extend_attention(q_groups, kb, vb, md.extend_layout, scale,
                                           window=self.windows[layer_id], tiles=self.tiles)  # [T, Hkv, G, D]
        return out.view(t, -1)  # [T, Hq * D]


def decode_mask(seq_lens: torch.Tensor, kv_len: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """[B, 1, 1, Lkv] additive: key j of request b is attended iff j < seq_lens[b] (and, with a sliding
    window, j >= seq_lens[b] - window)."""
    j = torch.arange(kv_len, device=seq_lens.device)[None, :]
    seq = seq_lens[:, None]
    allowed = (j < seq) if window is None else (j < seq) & (j >= seq - window)
    return additive(allowed[:, None, None, :], dtype)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) -> 0 / -inf in `dtype`."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
