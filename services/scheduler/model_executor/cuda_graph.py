"""CUDA graphs for DECODE batches: one graph per padded batch size (and KV-length bucket for torch SDPA).

The eager decode path launches ~20 small kernels per layer; at small batch sizes the GPU waits on
Python. A graph replays them all in one launch. Graphs need static shapes and addresses, so:
- inputs live in static buffers sized for the largest captured batch; a batch of `bs` requests is
  padded to the next captured size, the padding rows read token 0 at position 0, write their K/V to
  the pool's reserved dummy slot 0 and attend only to slot 0;
- the SDPA backend gathers a fixed number of KV slots per request, so its graphs are keyed by a
  power-of-two bucket of the longest context in the batch (masked past each request's length).
  Graphs of the smallest bucket are captured at start; larger buckets on first use;
- the Triton backend reads req_to_token in place with a fixed split count (`kv_buckets = False`):
  static row indices and lengths are all it needs, one graph per batch size covers every length;
- backends with `graph_capable = False` (FlashInfer, whose plans are not wired for capture) run eagerly.
All graphs share one memory pool. The same model code and attention backend run eager and captured.

`emulate=True` replaces the CUDA graph by a recording of the captured function that replay reruns over
the same static buffers: the capture/replay logic (static inputs, padding rows, bucket choice,
metadata views) is then tested on CPU (tests/scheduler/test_cuda_graph_logic.py).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any

import torch

from services.scheduler.attention.backend import SDPAMetadata, decode_mask
from services.scheduler.model_executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

MIN_KV_BUCKET = 256


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    return sorted(set(sizes) | {max_bs})


def kv_buckets(max_len: int) -> list[int]:
    out, b = [], MIN_KV_BUCKET
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


class _Recorded:
    """emulate=True's stand-in for a torch.cuda.CUDAGraph: replay reruns the captured function with the
    capture-time metadata (as a graph's kernels keep the addresses they were captured with), so
    whatever replay did not copy into the static buffers shows up as a wrong result."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor, backend: Any, metadata: Any) -> None:
        self.fn, self.out, self.backend, self.metadata = fn, out, backend, metadata

    def replay(self) -> None:
        self.backend.metadata = self.metadata
        self.out.copy_(self.fn())


class CudaGraphRunner:
    def __init__(self, runner, max_bs: int, emulate: bool = False) -> None:
        self.emulate = emulate
        self.runner = runner
        self.model = runner.model
        self.backend = runner.attn_backend
        self.device = runner.device
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        max_len = runner.req_to_token_pool.req_to_token.shape[1]
        # Triton: one "bucket" (every length); SDPA: power-of-two buckets of the gathered length.
        self.bucketed = getattr(self.backend, "kv_buckets", True)
        self.buckets = kv_buckets(max_len) if self.bucketed else [max_len]
        dev, kv_dtype = self.device, runner.token_to_kv_pool.dtype
        # Static inputs, [max_bs] / [max_bs * max_len]; each graph uses a prefix of them.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)  # 0 = dummy slot
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)  # Triton's
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        n = self.max_bs * max_len if self.bucketed else 0  # SDPA's gather index and mask
        self.kv_index = torch.zeros(n, dtype=torch.int64, device=dev)
        self.mask = torch.zeros(n, dtype=kv_dtype, device=dev)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.enabled = getattr(self.backend, "graph_capable", True)
        if self.enabled:
            for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its pool memory
                self._capture(bs, self.buckets[0] if self.bucketed else 0)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (self.enabled and batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs
                and max(batch.seq_lens_cpu) <= self.buckets[-1])

    def _views(self, bs: int, kv_len: int) -> Any:
        if not self.bucketed:
            return self.backend.graph_metadata(self.out_cache_loc[:bs], self.req_pool_indices[:bs],
                                               self.seq_lens[:bs])
        n = bs * kv_len
        return SDPAMetadata(is_decode=True, out_cache_loc=self.out_cache_loc[:bs],
                            kv_index=self.kv_index[:n].view(bs, kv_len),
                            mask=self.mask[:n].view(bs, 1, 1, kv_len), batch_size=bs)

    def _fill_padding(self, md: Any, start: int) -> None:
        """Rows >= start: token 0 at position 0 into dummy slot 0, attending to one key only (SDPA: slot
        0; Triton: position 0 of request row 0, whose entry always names a valid slot)."""
        self.input_ids[start:md.batch_size] = 0
        self.positions[start:md.batch_size] = 0
        md.out_cache_loc[start:] = 0
        if not self.bucketed:
            self.req_pool_indices[start:md.batch_size] = 0
            self.seq_lens[start:md.batch_size] = 1
            return
        assert md.kv_index is not None and md.mask is not None  # _views sets both
        md.kv_index[start:] = 0
        md.mask[start:] = float("-inf")
        md.mask[start:, :, :, 0] = 0.0

    @torch.inference_mode()
    def _capture(self, bs: int, kv_len: int) -> None:
        md = self._views(bs, kv_len)
        self._fill_padding(md, 0)
        self.backend.metadata = md

        def run() -> torch.Tensor:
            return self.model(self.input_ids[:bs], self.positions[:bs], self.backend, None)

        if self.emulate:
            out = run()
            self.graphs[(bs, kv_len)] = (_Recorded(run, out, self.backend, md), out)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm kernels and allocator outside the graph
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = run()  # [bs, V] float32, a static output
        torch.cuda.synchronize(self.device)
        self.graphs[(bs, kv_len)] = (graph, out)

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        pad_bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        kv_len = self.buckets[bisect.bisect_left(self.buckets, max(batch.seq_lens_cpu))] if self.bucketed else 0
        if (pad_bs, kv_len) not in self.graphs:
            logger.info("capturing CUDA graph bs=%d kv_len=%d", pad_bs, kv_len)
            self._capture(pad_bs, kv_len)
        graph, out = self.graphs[(pad_bs, kv_len)]
        md = self._views(pad_bs, kv_len)
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        md.out_cache_loc[:bs].copy_(batch.out_cache_loc)
        if self.bucketed:
            assert md.kv_index is not None and md.mask is not None  # _views sets both
            md.kv_index[:bs].copy_(self.runner.req_to_token_pool.req_to_token[batch.req_pool_indices, :kv_len])
            md.mask[:bs].copy_(decode_mask(batch.seq_lens, kv_len, md.mask.dtype))
        else:
            self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
            self.seq_lens[:bs].copy_(batch.seq_lens)
        if pad_bs > bs:
            self._fill_padding(md, bs)
        graph.replay()
        return out[:bs].clone()  # the static output is overwritten by the next replay
