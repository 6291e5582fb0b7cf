"""oneDNN-packed linear layers against F.linear, and the swap over a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.kernels import cpu_kernels, cpu_linear

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


bf16 = pytest.mark.skipif(not cpu_linear.supported(torch.bfloat16), reason="no oneDNN bf16 linear in this torch")


@bf16
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_weights_compute_what_a_bf16_linear_does(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    w, x = torch.randn(96, 48) * 0.1, torch.randn(rows, 48)
    b = torch.randn(96) if bias else None
    layer = cpu_linear.PackedLinear(w, b, torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and isinstance(layer.weight, nn.Parameter)
    got = layer(x)
    assert got.dtype == torch.float32  # activations stay float32 around the bf16 GEMM
    # The bf16 GEMM of the rounded input (float32 accumulation, output rounded to bf16), bias in float32.
    want = F.linear(x.bfloat16(), w.bfloat16()).float() + (0 if b is None else b)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    # ... and not the float32 product: the rounding is really there (a float32 fallback would pass above).
    assert (got - F.linear(x, w, b)).abs().max() > 1e-4


@bf16
def test_bf16_small_batches_go_to_the_native_kernel_and_agree_with_onednn() -> None:
    native = cpu_kernels.load()
    if native is None:
        pytest.skip("no C compiler on this machine")
    torch.manual_seed(0)
    w, b = torch.randn(96, 48) * 0.1, torch.randn(96)
    layer = cpu_linear.PackedLinear(w, b, torch.bfloat16, native=native)
    onednn = cpu_linear.PackedLinear(w, b, torch.bfloat16)
    assert layer.tiled is None  # 48 inputs: not a shape the AMX tiles take, which would take every row count
    for rows in (1, cpu_linear.BF16_SMALL_T - 1, cpu_linear.BF16_SMALL_T):
        x = torch.randn(rows, 48)
        got = layer(x)
        if rows < cpu_linear.BF16_SMALL_T:  # the native kernel's float32 sums, bias added after
            assert torch.equal(got, native.linear_bf16w(x, layer.weight) + b)
        else:
            assert torch.equal(got, onednn(x))
        # oneDNN rounds its output to bf16: the two paths agree to that rounding.
        torch.testing.assert_close(got, onednn(x), rtol=1e-2, atol=1e-2)
    # float32 weights never take it
    assert cpu_linear.PackedLinear(w, None, torch.float32, native=native).native is None


@bf16
def test_bf16_mid_batches_go_to_the_tile_gemm_and_agree_with_onednn() -> None:
    native = cpu_kernels.load()
    if native is None or not native.tiles:
        pytest.skip("no AMX tiles on this machine")
    torch.manual_seed(0)
    w, b = torch.randn(96, 64) * 0.1, torch.randn(96)
    layer = cpu_linear.PackedLinear(w, b, torch.bfloat16, native=native)
    onednn = cpu_linear.PackedLinear(w, b, torch.bfloat16)
    assert layer.tiled is not None and onednn.tiled is None
    for rows in (1, cpu_linear.BF16_SMALL_T - 1, cpu_linear.BF16_SMALL_T, 33, cpu_linear.TILES_MAX_T,
                 cpu_linear.TILES_MAX_T + 1):
        x = torch.randn(rows, 64)
        got = layer(x)
        if rows <= cpu_linear.TILES_MAX_T:
            assert layer.tiled is not None
            assert torch.equal(got, native.linear_tiles(x, layer.tiled) + b)
        else:
            assert torch.equal(got, onednn(x))
        # Both round their output to bf16 (sums in another order): they agree to that rounding.
        torch.testing.assert_close(got, onednn(x), rtol=1e-2, atol=1e-2)
    plain = cpu_linear.PackedLinear(w, None, torch.bfloat16, native=native)
    plain.out_bf16 = True  # a consumer that reads bf16 gets the same values
    x = torch.randn(40, 64)
    got = plain(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), native.linear_tiles(x, layer.tiled))
    # A weight update (repack) reaches the tile copy too.
    plain.weight.data.mul_(-1)
    cpu_linear.repack_linears(nn.Sequential(plain))
    assert torch.equal(plain(x).float(), -got.float())


@bf16
def test_bf16_tied_copy_follows_its_source_on_repack() -> None:
    embed = nn.Parameter(torch.randn(32, 16), requires_grad=False)
    head = cpu_linear.PackedLinear(embed, None, torch.bfloat16, tied=True)
    assert "weight" not in dict(head.named_parameters())  # a buffer: no checkpoint tensor fills it
    x = torch.randn(5, 16)
    embed.data.mul_(-1)  # a weight update writes the embedding in place
    stale = head(x)
    cpu_linear.repack_linears(nn.Sequential(head))
    torch.testing.assert_close(head(x), -stale, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(head(x), F.linear(x.bfloat16(), embed.bfloat16()).float(), rtol=1e-2, atol=1e-2)


@bf16
def test_pack_linears_in_bf16_drops_the_float32_weights() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(6, 8)
    want = model(x)
    assert cpu_linear.pack_linears(model, torch.bfloat16) == 2
    assert {p.dtype for n, p in model.named_parameters() if n.endswith("weight")} == {torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if n.endswith("bias")} == {torch.float32}
    torch.testing.assert_close(model(x), want, rtol=5e-2, atol=5e-2)


def test_padded_rows_bound_the_row_counts_onednn_meets() -> None:
    for rows in range(1, cpu_linear.PAD_FROM):
        assert cpu_linear.padded_rows(rows) == rows
    counts = {cpu_linear.padded_rows(rows) for rows in range(cpu_linear.PAD_FROM, 8193)}
    for rows in range(cpu_linear.PAD_FROM, 8193):
        assert rows <= cpu_linear.padded_rows(rows) <= rows * 17 // 16
    assert len(counts) == 7 * 16 + 1  # 16 per power of two from 64 to 8,192 (and 8,192 itself)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_gemm_rows_are_the_unpadded_gemm_rows(dtype: torch.dtype) -> None:
    """The padding rows change nothing in the real ones, and never reach the caller."""
    if not cpu_linear.supported(dtype):
        pytest.skip(f"no oneDNN {dtype} linear in this torch")
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64) * 0.1, torch.randn(96), torch.randn(1000, 64)
    assert cpu_linear.padded_rows(1000) == 1024
    layer = cpu_linear.PackedLinear(w, b, dtype)  # no native kernels: oneDNN takes every size here
    got = layer(x)
    assert got.shape == (1000, 96) and got.is_contiguous()
    unpadded = torch.ops.mkldnn._linear_pointwise(x.to(dtype), layer.packed, None, "none", [], "").float() + b
    assert torch.equal(got, unpadded)
