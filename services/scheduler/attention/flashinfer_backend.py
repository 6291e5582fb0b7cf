"""Attention over the KV pool with FlashInfer's paged kernels (CUDA only; `flashinfer-python`).

The pool is FlashInfer's paged layout with a page of one token: each layer's K/V buffer
[slots, Hkv, D] is viewed as [slots, 1, Hkv, D] ("NHD"), and a request's pages are its
req_to_token row, flattened per pass into the CSR arrays (indptr, indices) FlashInfer plans with.
The new tokens' K/V are written to the pool first, so EXTEND is one causal paged prefill over
prefix + new (FlashInfer aligns the causal mask to the end of each request's keys).

Planning happens once per pass in init_forward_metadata, one plan per distinct sliding window
(FlashInfer's window_left = window - 1: HF's i - w < j <= i). Decode steps run eagerly: CUDA-graph
capture of FlashInfer's wrappers (fixed plan buffers) is not wired, so cuda_graph.py skips this
backend (`graph_capable = False`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from services.scheduler.kvcache.memory_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-K scratch; 128-256 MiB is what its examples and SGLang use


def available() -> str | None:
    """None when FlashInfer can run here, else why not."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        return f"flashinfer does not import ({e}); pip install flashinfer-python"
    return None


class FlashInferAttnBackend:
    name = "flashinfer"
    graph_capable = False  # module doc

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: TokenToKVPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scaling: float | None = None,
                 sliding_windows: Sequence[int | None] | None = None) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(f"attention_backend flashinfer: {why}")
        import flashinfer

        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = kv_pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scaling if scaling is not None else head_dim ** -0.5
        self.device = kv_pool.device
        self.dense = None
        windows = list(sliding_windows) if sliding_windows is not None else [None] * kv_pool.num_layers
        self.window_left = [w - 1 if w is not None and w > 0 else -1 for w in windows]
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode = {w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                                        use_tensor_cores=num_heads > num_kv_heads)
                       for w in set(self.window_left)}
        self.prefill = {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
                        for w in set(self.window_left)}
        self.metadata: Any = None  # what forward needs: (out_cache_loc, split point or None)
        self._mode: tuple[bool, int | None] = (True, None)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.num_decode:
            extend, decode, t = batch.split()
            self._plan(extend)
            self._plan(decode)
            self._mode = (False, t)
        else:
            self._plan(batch)
            self._mode = (batch.mode == ForwardMode.DECODE, None)
        self.metadata = batch.out_cache_loc

    def _plan(self, batch: ForwardBatch) -> None:
        dev = self.device
        seq = batch.seq_lens_cpu
        indptr = torch.zeros(len(seq) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(seq, dtype=torch.int32), 0, out=indptr[1:])
        rows = self.req_to_token[batch.req_pool_indices]
        keep = torch.arange(rows.shape[1], device=dev)[None, :] < batch.seq_lens[:, None]
        indices = rows[keep].to(torch.int32)  # each request's slots, in order, concatenated
        last = torch.ones(len(seq), dtype=torch.int32)
        dtype = self.kv_pool.dtype
        common = dict(sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype)
        if batch.mode == ForwardMode.DECODE:
            for w, wrapper in self.decode.items():
                wrapper.plan(indptr.to(dev), indices, last.to(dev), self.num_heads, self.num_kv_heads,
                             self.head_dim, 1, window_left=w, **common)
            return
        qo = torch.zeros(len(seq) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(batch.extend_lens, dtype=torch.int32), 0, out=qo[1:])
        for w, pre in self.prefill.items():
            pre.plan(qo.to(dev), indptr.to(dev), indices, last.to(dev), self.num_heads, self.num_kv_heads,
                     self.head_dim, 1, causal=True, window_left=w, **common)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq * D]."""
        self.kv_pool.set_kv_buffer(layer_id, self.metadata, k, v)
        kb, vb = self.kv_pool.get_kv_buffer(layer_id)
        cache = (kb.unsqueeze(1), vb.unsqueeze(1))  # [slots, page=1, Hkv, D]
        w = self.window_left[layer_id]
        q = q.to(kb.dtype).contiguous()
        is_decode, t = self._mode
        if t is not None:
            out = torch.cat([self.prefill[w].run(q[:t], cache), self.decode[w].run(q[t:], cache)])
        elif is_decode:
            out = self.decode[w].run(q, cache)
        else:
            out = self.prefill[w].run(q, cache)
        return out.reshape(q.shape[0], -1)
