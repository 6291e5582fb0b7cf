"""The Triton paged-attention kernels against a dense torch reference, under Triton's interpreter on
CPU (conftest.py), and a mutation check: the same comparisons fail on copies of the kernels with a
broken mask or index, so these tests can catch such bugs.

Small shapes (a few requests, lengths up to ~100, 4 query heads) keep the interpreter fast.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.scheduler.attention.interp import DEVICE, HAS_TRITON, INTERPRET, SKIP_REASON, kernels, load_copy

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason=SKIP_REASON)

NUM_SLOTS = 600
HEADS = 4


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              window: int | None) -> torch.Tensor:
    """q [n, Hq, D] at positions q_pos against keys at positions 0..len(k)-1: causal, windowed."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * q.shape[-1] ** -0.5
    j = torch.arange(k.shape[0])
    visible = j[None, :] <= q_pos[:, None]
    if window:
        visible &= j[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


class Pool:
    """A K/V pool of random slots (slot 0 too: a read past a request's end sees real numbers) and
    req_to_token rows holding each request's positions at scattered slots."""

    def __init__(self, lens: list[int], num_kv_heads: int, head_dim: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=g)
        self.v = torch.randn(NUM_SLOTS, num_kv_heads, head_dim, generator=g)
        self.req_to_token = torch.zeros(len(lens) + 2, 128, dtype=torch.int64)
        free = (torch.randperm(NUM_SLOTS - 1, generator=g) + 1).tolist()
        # Rows in a shuffled order: row b of the batch is not row b of req_to_token.
        self.rows = torch.randperm(len(lens) + 2, generator=g)[:len(lens)]
        for row, n in zip(self.rows.tolist(), lens):
            self.req_to_token[row, :n] = torch.tensor([free.pop() for _ in range(n)])
        self.gen = g

    def seq(self, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.req_to_token[self.rows[b], :n]
        return self.k[slots], self.v[slots]


def check_decode(mod: ModuleType, lens: list[int], num_kv_heads: int, head_dim: int, window: int | None,
                 num_splits: int = 4) -> None:
    pool = Pool(lens, num_kv_heads, head_dim, seed=sum(lens) + head_dim + num_kv_heads)
    q = torch.randn(len(lens), HEADS, head_dim, generator=pool.gen)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    out = mod.decode_attention(on(q), on(pool.k), on(pool.v), on(pool.req_to_token), on(pool.rows),
                               on(torch.tensor(lens)), head_dim ** -0.5, sliding_window=window,
                               num_splits=num_splits).cpu()
    for b, n in enumerate(lens):
        k, v = pool.seq(b, n)
        ref = reference(q[b:b + 1], k, v, torch.tensor([n - 1]), window)[0]
        torch.testing.assert_close(out[b], ref, atol=2e-5 if INTERPRET else 2e-3, rtol=0)


def check_extend(mod: ModuleType, prefix: list[int], new: list[int], num_kv_heads: int, head_dim: int,
                 window: int | None) -> None:
    lens = [p + n for p, n in zip(prefix, new)]
    pool = Pool(lens, num_kv_heads, head_dim, seed=sum(lens) + head_dim + num_kv_heads)
    q = torch.randn(sum(new), HEADS, head_dim, generator=pool.gen)
    # The new tokens' K/V, packed; the reference reads them from the pool where the backend writes them.
    k_new = torch.cat([pool.seq(b, n)[0][p:] for b, (p, n) in enumerate(zip(prefix, lens))])
    v_new = torch.cat([pool.seq(b, n)[1][p:] for b, (p, n) in enumerate(zip(prefix, lens))])
    starts = torch.tensor([0] + new).cumsum(0)[:-1]
    on = lambda t: t.to(DEVICE)  # noqa: E731
    out = mod.extend_attention(on(q), on(k_new), on(v_new), on(pool.k), on(pool.v), on(pool.req_to_token),
                               on(pool.rows), on(torch.tensor(prefix)), on(torch.tensor(new)), on(starts),
                               max(new), head_dim ** -0.5, sliding_window=window).cpu()
    for b, (p, n, s) in enumerate(zip(prefix, new, starts.tolist())):
        k, v = pool.seq(b, p + n)
        ref = reference(q[s:s + n], k, v, torch.arange(p, p + n), window)
        torch.testing.assert_close(out[s:s + n], ref, atol=2e-5 if INTERPRET else 2e-3, rtol=0)


# (num_kv_heads, head_dim, sliding_window) with 4 query heads: MHA, GQA 2 and 4, D 64 and 128, and
# D=80 (not a power of two); the window on a GQA shape of each head dim. Few cases: the interpreter
# is slow (about 0.5 s a case).
CASES = [(4, 64, None), (2, 128, None), (1, 64, None), (2, 64, 16), (1, 128, 16), (1, 80, None)]
DECODE_LENS = [1, 5, 64, 65, 100]          # one key; within a tile; a tile exactly; across tiles
EXTEND = ([0, 30, 64, 5, 0], [7, 1, 40, 70, 33])  # no prefix; prefix hit + one token; long both; > BLOCK_M


@pytest.mark.parametrize("num_kv_heads,head_dim,window", CASES)
def test_decode_matches_reference(num_kv_heads: int, head_dim: int, window: int | None) -> None:
    check_decode(kernels(), DECODE_LENS, num_kv_heads, head_dim, window)


def test_decode_split_count_does_not_change_the_result() -> None:
    # More splits than keys (empty splits are skipped) and a single split.
    for splits in (1, 32):
        check_decode(kernels(), [3, 100], 2, 64, None, num_splits=splits)


@pytest.mark.parametrize("num_kv_heads,head_dim,window", CASES)
def test_extend_matches_reference(num_kv_heads: int, head_dim: int, window: int | None) -> None:
    check_extend(kernels(), *EXTEND, num_kv_heads, head_dim, window)


def test_window_wider_than_context_is_full_attention() -> None:
    check_decode(kernels(), [5, 40], 2, 64, 1000)
    check_extend(kernels(), [3, 0], [4, 9], 2, 64, 1000)


# ---- mutation check: each mutant is the kernel file with one mask/index bug; the comparison must fail ----

MUTANTS = {
    "decode reads one key past seq_len": ("mask_n = offs_n < end\n", "mask_n = offs_n < end + 1\n"),
    "decode reads req_to_token one position late": (
        "row * stride_r2t + offs_n, mask=mask_n, other=0)\n",  # the first occurrence: stage 1's
        "row * stride_r2t + offs_n + 1, mask=mask_n, other=0)\n"),
    "decode window one key too wide": ("lo = tl.maximum(seq_len - window, 0)\n",
                                       "lo = tl.maximum(seq_len - window - 1, 0)\n"),
    "extend sees the next new token": ("(offs_n[None, :] <= offs_m[:, None])",
                                       "(offs_n[None, :] <= offs_m[:, None] + 1)"),
    "extend prefix window one key too wide": ("(offs_n[None, :] > pos_q[:, None] - window)",
                                              "(offs_n[None, :] >= pos_q[:, None] - window)"),
    "extend reads the prefix from the wrong row": ("row = tl.load(req_pool_indices + b)\n        prefix",
                                                   "row = tl.load(req_pool_indices + b) + 1\n        prefix"),
}


def mutant(tmp_path: Path, old: str, new: str) -> ModuleType:
    src = Path(kernels().__file__).read_text()
    assert old in src, f"mutation target not in the kernel source: {old!r}"
    path = tmp_path / "mutant_kernels.py"
    path.write_text(src.replace(old, new, 1))
    return load_copy(path, f"mutant_kernels_{tmp_path.name}")


@pytest.mark.parametrize("name", list(MUTANTS))
def test_broken_kernel_fails_the_comparison(tmp_path: Path, name: str) -> None:
    mod = mutant(tmp_path, *MUTANTS[name])
    with pytest.raises(AssertionError, match="not close"):  # the comparison's failure, not another assert
        if name.startswith("decode"):
            check_decode(mod, DECODE_LENS, 2, 64, 16 if "window" in name else None)
        else:
            check_extend(mod, *EXTEND, 2, 64, 16 if "window" in name else None)
