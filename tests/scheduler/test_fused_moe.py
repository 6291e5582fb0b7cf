"""The Triton MoE kernel (the CUDA path) on CPU under TRITON_INTERPRET=1, against the grouped torch
path the CPU serves with; on a GPU (marked cuda) the same comparison in bfloat16."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from services.scheduler.models.moe import GroupedExperts, Routing, route


@pytest.fixture(scope="module")
def fused_moe():
    """The kernel module loaded with the interpreter on (read when triton.jit decorates)."""
    name = "services.scheduler.kernels.fused_moe"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        sys.modules.pop(name, None)
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)  # a later CUDA test imports the compiled kernel
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def experts(num_experts: int, hidden: int, inter: int, seed: int) -> GroupedExperts:
    g = torch.Generator().manual_seed(seed)
    m = GroupedExperts(num_experts, hidden, inter)
    m.gate_up_proj.data = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    m.down_proj.data = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    return m


def test_align_lays_slots_out_by_expert_in_padded_blocks(fused_moe) -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    al = fused_moe.align(ids, num_experts=4, block_m=4)
    n = ids.numel()
    assert al.slots.numel() == 4 * al.block_expert.numel() and al.slots.numel() >= n + 4 * 3
    # expert 0: slots 1, 4; expert 1: slot 3; expert 3: slots 0, 2, 5; then blocks past the end
    assert al.block_expert.tolist()[:3] == [0, 1, 3] and set(al.block_expert.tolist()[3:]) == {4}
    assert al.slots.view(-1, 4)[:3].tolist() == [[1, 4, n, n], [3, n, n, n], [0, 2, 5, n]]


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_triton_experts_equal_the_grouped_path(fused_moe, tokens: int) -> None:
    m = experts(num_experts=8, hidden=40, inter=24, seed=tokens)  # widths off the block sizes: masks
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 40, generator=g)
    routing = route(torch.randn(tokens, 8, generator=g), top_k=2, renormalize=tokens % 2 == 0, dtype=x.dtype)
    got = fused_moe.fused_experts(x, m.gate_up_proj, m.down_proj, routing.weights, routing.ids)
    torch.testing.assert_close(got, m.grouped(x, routing), atol=1e-4, rtol=1e-4)


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
