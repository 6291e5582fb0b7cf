"""oneDNN-packed linear layers against F.linear, and the swap over a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.supported(), reason="no oneDNN packed linear in this torch")


@pytest.mark.parametrize("rows", [1, 3, 4, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_on_both_paths(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    w = torch.randn(96, 48) * 0.1
    b = torch.randn(96) if bias else None
    x = torch.randn(rows, 48)
    torch.testing.assert_close(cpu_linear.PackedLinear(w, b)(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_float32_cpu_linears_only() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)),
                          nn.Linear(4, 4).to(torch.float64))
    x = torch.randn(10, 8)
    want = model[2](model[1](model[0](x)))
    assert cpu_linear.pack_linears(model) == 2
    assert isinstance(model[0], cpu_linear.PackedLinear) and isinstance(model[2][0], cpu_linear.PackedLinear)  # type: ignore[index]
    assert isinstance(model[3], nn.Linear)  # float64 stays as it was
    torch.testing.assert_close(model[2](model[1](model[0](x))), want, rtol=1e-5, atol=1e-5)
    # The weights are the same tensors (loaders and the state dict still see them).
    assert "0.weight" in dict(model.named_parameters())
