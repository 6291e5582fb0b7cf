"""Attention over the KV pool with this project's Triton kernels (triton_kernels.py); CUDA's default.

Unlike the torch SDPA backend nothing is gathered or padded: the kernels read each request's K/V in
place through req_to_token, so the per-pass metadata is just the batch's rows, lengths and (EXTEND)
where each request's new tokens start. Decode's split-K scratch ([rows, Hq, splits, D] float32) is
allocated once for the largest batch, and the split count is fixed, so a CUDA graph keyed by batch
size alone captures a decode step for every context length (cuda_graph.py: `kv_buckets = False`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.scheduler.attention import triton_kernels
from services.scheduler.kvcache.memory_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class TritonMetadata:
    is_decode: bool
    out_cache_loc: torch.Tensor      # [T] int64 slots the new K/V go to
    req_pool_indices: torch.Tensor   # [B] int64 rows of req_to_token
    seq_lens: torch.Tensor           # [B] int64 keys per request after this pass
    batch_size: int
    prefix_lens: torch.Tensor | None = None  # EXTEND [B] int64 cached positions before this pass
    extend_lens: torch.Tensor | None = None  # EXTEND [B] int64 new tokens
    q_start: torch.Tensor | None = None      # EXTEND [B] int64 first new token of each request in [T]
    max_extend_len: int = 1
    # A mixed step (ForwardBatch.mix): the prefill part's and the decode part's metadata, and where the
    # decode tokens start in [T].
    parts: tuple[TritonMetadata, TritonMetadata, int] | None = None


class TritonAttnBackend:
    name = "triton"
    kv_buckets = False  # decode graphs need no KV-length bucket (module doc)

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scaling: float | None = None,
                 num_splits: int = triton_kernels.DEFAULT_NUM_SPLITS,
                 sliding_windows: Sequence[int | None] | None = None) -> None:
        """sliding_windows: per layer (None or <= 0: full attention); None: every layer full."""
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = kv_pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scaling if scaling is not None else head_dim ** -0.5
        self.num_splits = num_splits
        self.sliding_windows = list(sliding_windows) if sliding_windows is not None else None
        self.device = kv_pool.device
        self.dense = None  # no CPU decode cache (the runner's memory table looks for one)
        rows = self.req_to_token.shape[0]  # no decode batch is larger than the request rows
        self.mid_o = torch.empty(rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=self.device)
        self.mid_lse = torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=self.device)
        self.metadata: TritonMetadata = None  # type: ignore[assignment]  # set before any layer runs

    def window(self, layer_id: int) -> int | None:
        return self.sliding_windows[layer_id] if self.sliding_windows is not None else None

    # ---- per forward pass ----

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.num_decode:
            extend, decode, t = batch.split()
            self.metadata = TritonMetadata(False, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens,
                                           batch.batch_size, parts=(self._metadata(extend), self._metadata(decode), t))
            return
        self.metadata = self._metadata(batch)

    def _metadata(self, batch: ForwardBatch) -> TritonMetadata:
        if batch.mode == ForwardMode.DECODE:
            return TritonMetadata(True, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens, batch.batch_size)
        starts = [0]
        for n in batch.extend_lens[:-1]:
            starts.append(starts[-1] + n)
        host = torch.tensor([batch.prefix_lens, batch.extend_lens, starts], dtype=torch.int64)
        dev = host.to(self.device, non_blocking=True)  # one copy for the three
        return TritonMetadata(False, batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens, batch.batch_size,
                              prefix_lens=dev[0], extend_lens=dev[1], q_start=dev[2],
                              max_extend_len=max(batch.extend_lens))

    def graph_metadata(self, out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor) -> TritonMetadata:
        """Decode metadata over a CUDA graph's static buffers (cuda_graph.py)."""
        return TritonMetadata(True, out_cache_loc, req_pool_indices, seq_lens, out_cache_loc.shape[0])

    # ---- per layer ----

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq * D]."""
        md = self.metadata
        self.kv_pool.set_kv_buffer(layer_id, md.out_cache_loc, k, v)
        if md.parts is not None:
            ext_md, dec_md, t = md.parts
            return torch.cat([self._attend(q[:t], k[:t], v[:t], layer_id, ext_md),
                              self._attend(q[t:], k[t:], v[t:], layer_id, dec_md)])
        return self._attend(q, k, v, layer_id, md)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                md: TritonMetadata) -> torch.Tensor:
        kb, vb = self.kv_pool.get_kv_buffer(layer_id)
        q = q.to(kb.dtype)
        if md.is_decode:
            bs = md.batch_size
            out = triton_kernels.decode_attention(
                q, kb, vb, self.req_to_token, md.req_pool_indices, md.seq_lens, self.scale,
                sliding_window=self.window(layer_id), num_splits=self.num_splits,
                mid_o=self.mid_o[:bs], mid_lse=self.mid_lse[:bs])
            return out.view(bs, -1)
        assert md.prefix_lens is not None and md.extend_lens is not None and md.q_start is not None
        out = triton_kernels.extend_attention(
            q, k.to(kb.dtype), v.to(kb.dtype), kb, vb, self.req_to_token, md.req_pool_indices, md.prefix_lens,
            md.extend_lens, md.q_start, md.max_extend_len, self.scale, sliding_window=self.window(layer_id))
        return out.view(q.shape[0], -1)
