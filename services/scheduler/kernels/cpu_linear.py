"""float32 linear layers on CPU through oneDNN with weights packed once at load time.

torch's F.linear on CPU goes to MKL's sgemm, which on AMD CPUs takes a slow path: on this machine
(AMD EPYC, AVX-512) oneDNN with prepacked weights is 2.0-2.5x faster at every size from 7 tokens up
(measured: [64, 256] x [256, 1024] 146 against 320 us; [4096, 256] x [256, 1024] 8.5 against 20 ms)
and just as exact (fp32 math, max error against fp64 of the same order). Below SMALL_T tokens
(decode of one or two requests) the plain GEMM is faster, so each layer keeps both weights and
picks per call. The packed op is the one torch's inductor uses for frozen CPU linears
(torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise); when it is missing or misbehaves,
packing is skipped and everything stays on F.linear.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
SMALL_T = 4        # fewer rows than this: F.linear (oneDNN's call overhead dominates)
PACK_BATCH_HINT = 64


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


class PackedLinear(nn.Module):
    """y = x @ W^T + b with W also kept in oneDNN's packed layout (x: [T, in] float32 on CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = _pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < SMALL_T:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def supported() -> bool:
    """The packed op exists here and agrees with F.linear on a small case."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(16, 8), torch.randn(5, 8)
        return torch.allclose(PackedLinear(w, None)(x), F.linear(x, w), rtol=1e-4, atol=1e-5)
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN packed linear unavailable (%s)", e)
        return False


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of a float32 CPU model for a PackedLinear; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 \
                    and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                swapped += 1
    return swapped


def repack_linears(model: nn.Module) -> int:
    """Re-pack every PackedLinear from its (updated in place) weight; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.packed = _pack(m.weight)
            n += 1
    return n
