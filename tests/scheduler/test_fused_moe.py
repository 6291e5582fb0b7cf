"""The Triton MoE kernel (the CUDA path) on CPU under TRITON_INTERPRET=1, against the grouped torch
path the CPU serves with; on a GPU (marked cuda) the same comparison in bfloat16.

The interpreter is chosen when triton is first imported (torch and transformers import it too), so
the interpreted checks run in a child process started with TRITON_INTERPRET=1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.scheduler.models.moe import GroupedExperts, Routing, route
from tests.conftest import ROOT


def experts(num_experts: int, hidden: int, inter: int, seed: int) -> GroupedExperts:
    g = torch.Generator().manual_seed(seed)
    m = GroupedExperts(num_experts, hidden, inter)
    m.gate_up_proj.data = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    m.down_proj.data = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    return m


def check_align() -> None:
    from services.scheduler.kernels.fused_moe import align

    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    al = align(ids, num_experts=4, block_m=4)
    n = ids.numel()
    assert al.slots.numel() == 4 * al.block_expert.numel() and al.slots.numel() >= n + 4 * 3
    # expert 0: slots 1, 4; expert 1: slot 3; expert 3: slots 0, 2, 5; then blocks past the end
    assert al.block_expert.tolist()[:3] == [0, 1, 3] and set(al.block_expert.tolist()[3:]) == {4}
    assert al.slots.view(-1, 4)[:3].tolist() == [[1, 4, n, n], [3, n, n, n], [0, 2, 5, n]]


def check_kernel(tokens: int) -> None:
    from services.scheduler.kernels.fused_moe import fused_experts

    m = experts(num_experts=8, hidden=40, inter=24, seed=tokens)  # widths off the block sizes: masks
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 40, generator=g)
    routing = route(torch.randn(tokens, 8, generator=g), top_k=2, renormalize=tokens % 2 == 0, dtype=x.dtype)
    got = fused_experts(x, m.gate_up_proj, m.down_proj, routing.weights, routing.ids)
    torch.testing.assert_close(got, m.grouped(x, routing), atol=1e-4, rtol=1e-4)


def check_all() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check_align()
    for tokens in (1, 40):  # decode batch 1; more rows than a block for some experts
        check_kernel(tokens)
    print("fused_moe: all checks passed")


def test_triton_kernel_under_the_interpreter_equals_the_grouped_path() -> None:
    code = "from tests.scheduler.test_fused_moe import check_all; check_all()"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and "all checks passed" in out.stdout, out.stdout + out.stderr[-4000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_moe_block_matches_cpu_in_bfloat16() -> None:
    m = experts(num_experts=16, hidden=256, inter=128, seed=0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g)
    routing = route(torch.randn(64, 16, generator=g), top_k=4, renormalize=True, dtype=x.dtype)
    want = m.grouped(x, routing)
    cuda = m.to("cuda", torch.bfloat16)
    on_gpu = Routing(routing.weights.to("cuda", torch.bfloat16), routing.ids.to("cuda"))
    got = cuda(x.to("cuda", torch.bfloat16), on_gpu)
    torch.testing.assert_close(got.float().cpu(), want, atol=5e-2, rtol=5e-2)
