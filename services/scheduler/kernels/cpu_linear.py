"""Linear layers on CPU through oneDNN with weights packed once at load time, in float32 or bfloat16.

torch's F.linear on CPU goes to MKL's sgemm, which on AMD CPUs takes a slow path: on an AMD EPYC with
AVX-512, oneDNN with prepacked weights is 2.0-2.5x faster at every size from 7 tokens up (measured:
[64, 256] x [256, 1024] 146 against 320 us; [4096, 256] x [256, 1024] 8.5 against 20 ms) and just as
exact (fp32 math, max error against fp64 of the same order). Below SMALL_T tokens (decode of one or
two requests) the plain float32 GEMM is faster, so each float32 layer keeps both and picks per call.

bfloat16 (`--dtype bfloat16` on CPU): the weights are kept only in bf16, packed, and the GEMM runs in
bf16 with float32 accumulation, which CPUs with AVX512-BF16 or AMX do natively (SmolLM2's decode
shapes at batch 64 on the EPYC: 360-410 GFLOP/s against 195 packed float32; at batch 1, where reading
the weights is the cost, 35-50 against 23-33). The activations around each GEMM stay float32: the
input is rounded to bf16 on the way in and the output widened on the way out, so norms, rotary,
attention and the KV cache keep the float32 C kernels (see ModelRunner for the split). Where a C
kernel sits on either side (the norms, the SiLU gate, the residual add) it does the rounding and the
widening itself: `input_dtype` tells it what to write, `out_bf16` leaves the output to it.

oneDNN's bf16 GEMM costs several times what reading the weights does at a handful of rows (a Xeon
with AMX, SmolLM2-135M's linears at batch 1: 32.6 ms a step against 17.6 for the native kernel of
csrc/linear.c, which reads the plain bf16 weight once and dots it with every row; per shape 1.1-3.2x
at 1-2 rows, 0.8-1.6x at 4, 0.6-1.5x at 8, behind from 16). So with the native kernels, fewer than
BF16_SMALL_T rows go there where the CPU has no AMX. Its output is the float32 sum, where oneDNN's is
rounded to bf16.
Where the CPU has AMX, the weights also have a copy in the tile layout of csrc/linear.c's `linear_tiles`,
which streams each weight once through the tile unit at about the memory's rate, and every row count up
to TILES_MAX_T (a decode batch at any load, a short prefill) goes there: SmolLM2-135M's four projections
of a layer at 64 rows, weights cold as in a step, 0.50 against oneDNN's 0.99 ms (at 512 rows 2.5 against
4.5; at 2048 the two are even, and oneDNN keeps the larger batches); below BF16_SMALL_T rows it also beats
the native kernel, whose per-row dot products cost more with each row (all 120 projections of the model,
weights cold, at 1 row 10.0-11.9 against 15.3-15.7 ms, at 7 rows 9.5-10.0 against 24.8-25.2). Its output
is rounded to bf16 as oneDNN's is, so on AMX a row's result is the same bits at every batch size.

oneDNN builds (JIT-compiles) a GEMM for each row count it meets and caches it (1,024 entries): a prefill
of a row count not seen before paid 4-8 ms a projection shape for the build, ~30 ms of a 2,000-row
SmolLM2-135M prefill of ~380 ms (in process, prompts of varying length against the same length each
time). So from PAD_FROM rows on, the rows are padded with zeros up to the next of 16 steps per power of
two (`padded_rows`: at most 1/16 more rows to compute; up to 8,192 rows 176 counts a shape in all),
and the extra rows' output is dropped. Each row's result does not depend on the others.

The packed op is the one torch's inductor uses for frozen CPU linears
(torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise); when it is missing or misbehaves,
packing is skipped and everything stays on F.linear.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.kernels.cpu_kernels import NativeKernels

log = logging.getLogger(__name__)
SMALL_T = 4        # fewer rows than this: F.linear in float32 (oneDNN's call overhead dominates)
BF16_SMALL_T = 8   # fewer rows than this, with bf16 weights: the native kernel (csrc/linear.c)
TILES_MAX_T = 512  # up to this many rows, where the CPU has AMX: linear.c's tile GEMM
PACK_BATCH_HINT = 64
PAD_FROM = 64      # from this many rows, oneDNN's GEMMs run on padded_rows(rows)


def padded_rows(rows: int) -> int:
    """The rows oneDNN's GEMM runs at for `rows` (>= rows): below PAD_FROM the count itself (few counts,
    all cached), above it rounded up to a multiple of 1/16 of its power of two."""
    if rows < PAD_FROM:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 GEMMs in hardware (AVX512-BF16 or AMX); elsewhere oneDNN
    emulates them, slower than float32."""
    cpu = torch.cpu
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(cpu, probe, None)
        if fn is not None and fn():
            return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W in oneDNN's packed layout; x: [T, in] float32 on CPU, y: [T, out] float32.

    With `dtype` bfloat16 the weight is held (and packed) in bf16 only; `tied`: the weight is a bf16
    copy of another module's parameter (a tied lm_head's embedding), refreshed from it on repack;
    `native`: the kernels that take bf16 layers' small batches."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None = None,
                 tied: bool = False, native: NativeKernels | None = None) -> None:
        super().__init__()
        dtype = dtype or weight.dtype
        self.native = native if dtype == torch.bfloat16 else None
        self.tied_to: torch.Tensor | None = None
        if dtype == weight.dtype:
            self.weight = weight
        elif tied:  # a buffer: the checkpoint has no tensor of this name, the embedding is its source
            self.register_buffer("weight", weight.detach().to(dtype), persistent=False)
            self.tied_to = weight
        else:
            self.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
        self.bias = bias
        # bf16 weights: return the GEMM's bf16 output as is, for a consumer that reads bf16 (the
        # native SiLU gate or residual add); it holds the same values as the widened float32.
        self.out_bf16 = False
        self.packed = _pack(self.weight)
        # The weight in the tile GEMM's layout (None: no AMX, a shape it does not take, or float32).
        self.tiled = self.native.pack_tiles(self.weight) if self.native is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == torch.float32:
            if x.shape[0] < SMALL_T:
                return F.linear(x, w, self.bias)
            return self._onednn(x, self.bias)
        # bf16 weights under float32 activations: a bf16 GEMM (float32 accumulation) on the rounded
        # input (x float32, or already bf16 from a kernel that rounded it: input_dtype), widened back
        # unless `out_bf16`; the bias stays float32, added after.
        kernel = self.kernel(x.shape[0]) if x.stride(-1) == 1 else "onednn"
        if kernel == "small":
            assert self.native is not None
            y = self.native.linear_bf16w(x.float(), w)  # the float32 sum
        elif kernel == "tiles":
            assert self.native is not None and self.tiled is not None
            y = self.native.linear_tiles(x, self.tiled, torch.bfloat16 if self.out_bf16 else torch.float32)
        else:
            y = self._onednn(x, None)
            if not self.out_bf16:
                y = y.float()
        return y if self.bias is None else y.add_(self.bias)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """[T] int64: each row's argmax of forward(x), as the greedy sampler picks it (NativeKernels.argmax),
        where the tile GEMM takes these rows; None elsewhere (the caller takes forward's logits)."""
        if self.bias is not None or x.stride(-1) != 1 or self.kernel(x.shape[0]) != "tiles":
            return None
        assert self.native is not None and self.tiled is not None
        return self.native.linear_tiles_argmax(x, self.tiled)

    def kernel(self, rows: int) -> str:
        """Which GEMM `forward` runs on `rows` rows of contiguous input with bf16 weights: "small" (the native
        small-batch kernel, float32 sums; no AMX), "tiles" (linear.c's tile GEMM) or "onednn"."""
        if self.tiled is not None:
            return "tiles" if rows <= TILES_MAX_T else "onednn"
        return "small" if self.native is not None and rows < BF16_SMALL_T else "onednn"

    def _onednn(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The packed GEMM on x [T, in] (rounded to the weight's dtype) at padded_rows(T) rows: [T, out]
        in the weight's dtype, a view of the first T rows."""
        rows, dtype = x.shape[0], self.weight.dtype
        pad = padded_rows(rows)
        if pad == rows:
            xin = x.to(dtype)
        else:
            xin = x.new_empty((pad, x.shape[1]), dtype=dtype)
            xin[:rows].copy_(x)
            xin[rows:].zero_()
        return torch.ops.mkldnn._linear_pointwise(xin, self.packed, bias, "none", [], "")[:rows]

    def input_dtype(self, rows: int) -> torch.dtype:
        """The dtype the GEMM reads for `rows` rows: bf16 where the packed bf16 GEMM takes them, so a
        kernel writing this layer's input can round it itself (the same bits as the .to() here)."""
        if self.weight.dtype != torch.bfloat16 or self.kernel(rows) == "small":
            return torch.float32
        return torch.bfloat16

    def repack(self) -> None:
        """Re-pack after the weight (or the tied source) changed in place."""
        if self.tied_to is not None:
            self.weight.copy_(self.tied_to)
        self.packed = _pack(self.weight)
        if self.tiled is not None and self.native is not None:
            self.tiled = self.native.pack_tiles(self.weight)


def supported(dtype: torch.dtype = torch.float32) -> bool:
    """The packed op exists here and agrees with F.linear (in `dtype`) on a small case."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(16, 8), torch.randn(5, 8)
        got = PackedLinear(w, None, dtype)(x)
        want = F.linear(x.to(dtype), w.to(dtype)).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        return torch.allclose(got, want, rtol=tol * 10, atol=tol)
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN packed %s linear unavailable (%s)", dtype, e)
        return False


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.float32, native: NativeKernels | None = None) -> int:
    """Swap every float32 CPU nn.Linear of `model` for a PackedLinear holding its weight in `dtype`
    (the float32 weight is dropped when that is bf16; `native` takes its small batches); returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 \
                    and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child.weight, child.bias, dtype, native=native))
                swapped += 1
    return swapped


def repack_linears(model: nn.Module) -> int:
    """Re-pack every PackedLinear from its (updated in place) weight; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.repack()
            n += 1
    return n
