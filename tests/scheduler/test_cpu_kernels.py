"""The C decode-attention kernel against plain torch attention, and the fallback without a compiler."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from services.scheduler import cpu_kernels


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.NativeDecodeAttention:
    k = cpu_kernels.load_decode_attention()
    if k is None:
        pytest.skip("no C compiler on this machine")
    return k


def reference(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for b, n in enumerate(lens.tolist()):
        scores = (q[b] @ kt[b, :, :, :n]) * scale  # [H, G, n]
        out[b] = scores.softmax(-1) @ v[b, :, :n]
    return out


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("heads,group,dim", [(4, 2, 32), (2, 1, 64), (4, 3, 64), (1, 4, 128), (2, 7, 128),
                                             (8, 1, 16), (2, 5, 48)])
def test_matches_torch_attention_on_ragged_rows(kernel, threads: int, heads: int, group: int, dim: int) -> None:
    torch.manual_seed(heads * 100 + group * 10 + dim)
    b_cap, l_cap, b = 8, 96, 5
    kt = torch.randn(b_cap, heads, dim, l_cap)
    v = torch.randn(b_cap, heads, l_cap, dim)
    q = torch.randn(b, heads, group, dim)
    lens = torch.tensor([1, 96, 37, 2, 64], dtype=torch.int64)
    kt[:b, :, :, 70:] = float("nan")  # past every short row's length: must never be read
    v[:b, :, 70:] = float("nan")
    kt[1, :, :, 70:] = torch.randn(heads, dim, l_cap - 70)
    v[1, :, 70:] = torch.randn(heads, l_cap - 70, dim)
    got = kernel(q, kt, v, lens, dim ** -0.5)
    want = reference(q, kt, v, lens, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_loading_it_leaves_subnormals_alone(kernel) -> None:
    # -ffast-math at link time would add crtfastmath.o, which sets flush-to-zero process-wide.
    smallest_normal = sys.float_info.min
    assert smallest_normal / 2 > 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0


def test_refuses_lengths_past_the_buffer(kernel) -> None:
    kt, v = torch.zeros(2, 1, 32, 8), torch.zeros(2, 1, 8, 32)
    with pytest.raises(AssertionError):
        kernel(torch.zeros(2, 1, 1, 32), kt, v, torch.tensor([3, 9]), 1.0)
    with pytest.raises(AssertionError):
        kernel(torch.zeros(2, 1, 1, 32), kt, v, torch.tensor([0, 4]), 1.0)


def test_no_compiler_means_no_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_kernels.build(cache=str(tmp_path)) is None
    assert list(tmp_path.rglob("*.so")) == []


def test_build_is_cached(tmp_path: Path, kernel) -> None:
    first = cpu_kernels.build(cache=str(tmp_path))
    assert first is not None and first.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build(cache=str(tmp_path)) == first and first.stat().st_mtime_ns == mtime
