"""The C kernels against plain torch: attention (decode and prefill, the decode step's K/V store with it;
float32, bfloat16 and fp8 KV), the fp8 codecs, the dense decode rows' fill, rotary, the SiLU gate, the residual add with
RMSNorm, greedy argmax, and the small-batch linear over bf16 weights."""

from __future__ import annotations

import ctypes
import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from services.scheduler.kernels import cpu_kernels
from services.scheduler.kernels.cpu_kernels import bits, blocked_kt, kt_positions
from services.scheduler.kvcache.memory_pool import FP8_MAX, to_kv
from services.scheduler.models.rotary import RotaryEmbedding


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.NativeKernels:
    k = cpu_kernels.load()
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
    b_cap, l_cap, b = 8, 128, 5
    kt = torch.randn(b_cap, heads, dim, l_cap)
    v = torch.randn(b_cap, heads, l_cap, dim)
    q = torch.randn(b, heads, group, dim)
    lens = torch.tensor([1, 96, 37, 2, 64], dtype=torch.int64)
    kt[:b, :, :, 70:] = float("nan")  # past every short row's length: must never be read
    v[:b, :, 70:] = float("nan")
    kt[1, :, :, 70:] = torch.randn(heads, dim, l_cap - 70)
    v[1, :, 70:] = torch.randn(heads, l_cap - 70, dim)
    got = kernel.decode_attention(q, blocked_kt(kt), v, cpu_kernels.decode_layout(lens, l_cap), dim ** -0.5)
    want = reference(q, kt, v, lens, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_reads_each_request_from_its_dense_row(kernel, threads: int) -> None:
    """Requests in batch order, their rows anywhere in the buffers, q a strided view (as in a layer)."""
    torch.manual_seed(3)
    heads, group, dim, l_cap = 4, 2, 32, 64
    kt, v = torch.randn(6, heads, dim, l_cap), torch.randn(6, heads, l_cap, dim)
    lens = torch.tensor([5, 64, 17, 1, 40, 33], dtype=torch.int64)  # per dense row
    rows = torch.tensor([4, 0, 5, 2, 3, 1], dtype=torch.int64)      # request b -> dense row
    qkv = torch.randn(6, heads * group * dim + 100)                  # each request's q, then other columns
    q = qkv[:, :heads * group * dim].view(6, heads, group, dim)
    got = kernel.decode_attention(q, blocked_kt(kt), v, cpu_kernels.decode_layout(lens, l_cap, rows), dim ** -0.5)
    want = reference(q.contiguous(), kt[rows], v[rows], lens[rows], dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layout_visits_requests_that_share_a_prefix_one_after_another() -> None:
    """Batch order interleaves prefixes (a benchmark shuffles its prompts); the kernel's order groups
    them by entry, stable within one, rows without a prefix first."""
    lens = torch.full((6,), 90, dtype=torch.int64)
    entry = torch.tensor([1, 0, -1, 1, 0, 0], dtype=torch.int64)
    plen = torch.tensor([70, 64, 0, 70, 64, 0], dtype=torch.int64)  # the last row: entry set, no prefix
    rows = torch.tensor([0, 1, 2, 3, 4, 5])
    layout = cpu_kernels.decode_layout(lens, 96, rows.flip(0), entry=entry, plen=plen, p_cap=80, entries=2)
    assert layout.order is not None
    # batch b reads dense row 5 - b: entries by batch order are [-1, 0, 1, -1, 0, 1]
    assert layout.order.tolist() == [0, 3, 1, 4, 2, 5]
    assert cpu_kernels.decode_layout(lens, 96, rows).order is None  # no prefixes: batch order


@pytest.mark.parametrize("heads,group,dim", [(4, 2, 32), (2, 3, 64)])
def test_decode_over_shared_prefixes_matches_whole_rows(kernel, threads: int, heads: int, group: int,
                                                        dim: int) -> None:
    """Rows whose first keys sit in a shared prefix buffer give what their whole rows give."""
    torch.manual_seed(7)
    b, l_cap, p_cap = 5, 192, 130
    lens = torch.tensor([150, 3, 129, 70, 100], dtype=torch.int64)
    entry = torch.tensor([1, -1, 0, 1, 0], dtype=torch.int64)
    plen = torch.tensor([64, 0, 128, 64, 99], dtype=torch.int64)  # row 4 shares part of entry 0
    shared_kt, shared_v = torch.randn(2, heads, dim, p_cap), torch.randn(2, heads, p_cap, dim)
    kt, v = torch.randn(b, heads, dim, l_cap), torch.randn(b, heads, l_cap, dim)
    whole_kt, whole_v = kt.clone(), v.clone()  # each row's keys in one buffer, for the reference
    for r in range(b):
        n, e = int(plen[r]), int(entry[r])
        if n:
            whole_kt[r, :, :, :n], whole_kt[r, :, :, n:] = shared_kt[e, :, :, :n], kt[r, :, :, :l_cap - n]
            whole_v[r, :, :n], whole_v[r, :, n:] = shared_v[e, :, :n], v[r, :, :l_cap - n]
        kt[r, :, :, int(lens[r]) - n:] = float("nan")  # past each row's own keys: never read
        v[r, :, int(lens[r]) - n:] = float("nan")
    shared_kt[:, :, :, 128:] = float("nan")
    q = torch.randn(b, heads, group, dim)
    layout = cpu_kernels.decode_layout(lens, l_cap, entry=entry, plen=plen, p_cap=p_cap, entries=2)
    got = kernel.decode_attention(q, blocked_kt(kt), v, layout, dim ** -0.5, (shared_kt, shared_v))
    want = kernel.decode_attention(q, blocked_kt(whole_kt), whole_v, cpu_kernels.decode_layout(lens, l_cap),
                                   dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, reference(q, whole_kt, whole_v, lens, dim ** -0.5), rtol=1e-5, atol=1e-5)


def extend_reference(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, lens: list[int], prefix: list[int],
                     scale: float) -> torch.Tensor:
    """Per request: padded SDPA with the causal-after-prefix mask, as the torch backend does it."""
    outs, start = [], 0
    for b, (n, p) in enumerate(zip(lens, prefix)):
        qb = q[start:start + n].permute(1, 2, 0, 3)  # [H, G, n, D]
        i, j = torch.arange(n)[:, None], torch.arange(p + n)[None, :]
        mask = torch.zeros(n, p + n).masked_fill_(j > p + i, float("-inf"))
        out = F.scaled_dot_product_attention(qb, kt[b, :, None, :, :p + n].transpose(-1, -2),
                                             v[b, :, None, :p + n], attn_mask=mask, scale=scale)
        outs.append(out.permute(2, 0, 1, 3))  # [n, H, G, D]
        start += n
    return torch.cat(outs)


def pooled(kt: torch.Tensor, v: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The requests' keys scattered over a token-indexed pool [S, H, D] in random slots, and each request's
    slots [B, Lcap] (as req_to_token rows: past a request's keys, 0)."""
    b, heads, dim, l_cap = kt.shape
    perm = torch.randperm(b * l_cap + 7)
    pool_k = torch.full((len(perm), heads, dim), float("nan"))
    pool_v = pool_k.clone()
    slots = torch.zeros(b, l_cap, dtype=torch.int64)
    for r, n in enumerate(lens):
        slots[r, :n] = perm[r * l_cap: r * l_cap + n]
        pool_k[slots[r, :n]] = kt[r, :, :, :n].permute(2, 0, 1)
        pool_v[slots[r, :n]] = v[r, :, :n].transpose(0, 1)
    return pool_k, pool_v, slots


@pytest.mark.parametrize("heads,group,dim", [(4, 2, 32), (2, 1, 64), (1, 4, 128), (2, 5, 48), (2, 3, 32),
                                             (1, 12, 32)])
def test_extend_matches_masked_sdpa_on_ragged_requests(kernel, threads: int, heads: int, group: int,
                                                       dim: int) -> None:
    torch.manual_seed(heads * 100 + group * 10 + dim)
    # One request with no new tokens; new-token counts around the 8-row blocks of every group size.
    lens, prefix = [1, 70, 5, 130, 0, 64, 9, 17], [0, 0, 33, 2, 7, 64, 600, 3]
    l_cap = max(n + p for n, p in zip(lens, prefix)) + 3
    b = len(lens)
    kt = torch.randn(b, heads, dim, l_cap)
    v = torch.randn(b, heads, l_cap, dim)
    pool_k, pool_v, slots = pooled(kt, v, [n + p for n, p in zip(lens, prefix)])  # other slots: NaN, never read
    q = torch.randn(sum(lens), heads, group, dim)
    q_start = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)
    layout = cpu_kernels.extend_layout(slots, q_start, torch.tensor(prefix, dtype=torch.int64), len(pool_k))
    got = kernel.extend_attention(q, pool_k, pool_v, layout, dim ** -0.5)
    want = extend_reference(q, kt, v, lens, prefix, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,group,dim", [(2, 3, 64), (1, 4, 128), (3, 1, 32)])
@pytest.mark.parametrize("window", [0, 90])
def test_shared_prefixes_on_tiles_match_the_plain_layout(kernel, threads: int, heads: int, group: int, dim: int,
                                                        window: int) -> None:
    """bf16 prefixes in the tile layout (AMX): the prefix part of attention as two tile products over
    chunks of the rows sharing it, q and its probabilities rounded to bf16 for them. Against the same
    prefixes in the plain layout (float32 arithmetic on the same bf16 keys): within bf16's rounding, with
    more rows on one prefix than a chunk holds, prefixes of lengths off the tile sizes, rows sharing only
    part of one, rows without any, and a window that starts inside the prefix."""
    if not kernel.tiles_for(torch.bfloat16, dim):
        pytest.skip("no AMX-BF16 tiles on this CPU")
    from services.scheduler.attention.shared_prefix import tiled_k, tiled_v

    torch.manual_seed(dim + window)
    b, l_cap, p_cap, e = 45, 64, 160, 3
    lens_p = [99 if r % 3 == 0 else 128 if r % 3 == 1 else 0 for r in range(b)]  # entry 0: 99, 1: 128
    plen = torch.tensor(lens_p, dtype=torch.int64)
    plen[4] = 64  # shares the first 64 of entry 1's 128
    entry = torch.tensor([r % 3 if lens_p[r] else -1 for r in range(b)], dtype=torch.int64)
    lens = plen + torch.randint(1, l_cap, (b,))
    bf = torch.bfloat16
    pk, pv = torch.randn(e, heads, dim, p_cap).to(bf), torch.randn(e, heads, p_cap, dim).to(bf)
    kt, v = blocked_kt(torch.randn(b, heads, dim, l_cap).to(bf)), torch.randn(b, heads, l_cap, dim).to(bf)
    tk, tv = torch.empty_like(pk), torch.empty_like(pv)  # the same prefixes in the tile layout
    tiled_k(tk).copy_(pk.view(e, heads, dim // 2, 2, p_cap).transpose(3, 4))
    tiled_v(tv).copy_(pv.view(e, heads, p_cap // 2, 2, dim).transpose(3, 4))
    q = torch.randn(b, heads, group, dim)
    def layout(tiles: bool, p: int = p_cap) -> cpu_kernels.DecodeLayout:
        return cpu_kernels.decode_layout(lens, l_cap, entry=entry, plen=plen, p_cap=p, entries=e, prefix_tiles=tiles)

    want = kernel.decode_attention(q, kt, v, layout(False), dim ** -0.5, (pk, pv), window=window or None)
    got = kernel.decode_attention(q, kt, v, layout(True), dim ** -0.5, (tk, tv), window=window or None)
    assert got.isfinite().all()
    assert float((got - want).norm() / want.norm()) < 1e-2
    torch.testing.assert_close(got, want, rtol=0.0, atol=3e-2)
    no_prefix = plen == 0
    torch.testing.assert_close(got[no_prefix], want[no_prefix], rtol=0.0, atol=0.0)  # the per-row path, untouched
    with pytest.raises(AssertionError):  # the tile layout's Pcap is a multiple of TILE_ALIGN
        layout(True, 144)


@pytest.mark.parametrize("heads,group,dim", [(2, 2, 32), (1, 4, 256), (2, 1, 64)])
@pytest.mark.parametrize("window", [1, 7, 16])
def test_decode_with_a_window_reads_only_its_last_keys(kernel, threads: int, heads: int, group: int, dim: int,
                                                       window: int) -> None:
    """A row of n keys attends to keys [n - window, n) only: the keys before are NaN and never read,
    also when they sit in a shared prefix buffer."""
    torch.manual_seed(window * 10 + dim)
    b, l_cap, p_cap = 4, 64, 40
    lens = torch.tensor([50, 3, 40, 33], dtype=torch.int64)
    entry = torch.tensor([0, -1, 0, 0], dtype=torch.int64)
    plen = torch.tensor([32, 0, 32, 30], dtype=torch.int64)
    shared_kt, shared_v = torch.randn(1, heads, dim, p_cap), torch.randn(1, heads, p_cap, dim)
    kt, v = torch.randn(b, heads, dim, l_cap), torch.randn(b, heads, l_cap, dim)
    whole_kt, whole_v = torch.randn(b, heads, dim, l_cap + p_cap), torch.randn(b, heads, l_cap + p_cap, dim)
    for r in range(b):
        n, total = int(plen[r]), int(lens[r])
        whole_kt[r, :, :, :n], whole_v[r, :, :n] = shared_kt[0, :, :, :n], shared_v[0, :, :n]
        whole_kt[r, :, :, n:n + l_cap], whole_v[r, :, n:n + l_cap] = kt[r], v[r]
        lo = max(0, total - window)
        kt[r, :, :, :max(0, lo - n)] = float("nan")  # before the window: never read
        v[r, :, :max(0, lo - n)] = float("nan")
    window_lo = int((lens - window).clamp(min=0).min())
    shared_kt[:, :, :, :min(window_lo, 30)] = float("nan")
    shared_v[:, :, :min(window_lo, 30)] = float("nan")
    q = torch.randn(b, heads, group, dim)
    layout = cpu_kernels.decode_layout(lens, l_cap, entry=entry, plen=plen, p_cap=p_cap, entries=1)
    got = kernel.decode_attention(q, blocked_kt(kt), v, layout, dim ** -0.5, (shared_kt, shared_v), window=window)
    want = torch.empty_like(q)
    for r in range(b):
        lo, n = max(0, int(lens[r]) - window), int(lens[r])
        scores = (q[r] @ whole_kt[r, :, :, lo:n]) * dim ** -0.5
        want[r] = scores.softmax(-1) @ whole_v[r, :, lo:n]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,group,dim", [(2, 2, 32), (1, 4, 256), (2, 1, 64), (1, 12, 32)])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_extend_with_a_window_matches_the_sliding_mask(kernel, threads: int, heads: int, group: int, dim: int,
                                                       window: int) -> None:
    """Token at position p sees keys (p - window, p]: the blocks of new tokens and the tokens after
    them, with and without a cached prefix, against SDPA with HF's sliding mask."""
    torch.manual_seed(window * 100 + dim + group)
    lens, prefix = [1, 40, 5, 17, 0, 9], [0, 0, 33, 2, 7, 20]
    l_cap = max(n + p for n, p in zip(lens, prefix)) + 3
    b = len(lens)
    kt, v = torch.randn(b, heads, dim, l_cap), torch.randn(b, heads, l_cap, dim)
    pool_k, pool_v, slots = pooled(kt, v, [n + p for n, p in zip(lens, prefix)])
    for r, p in enumerate(prefix):  # keys before the first new token's window: never read
        lo = max(0, p + 1 - window)
        pool_k[slots[r, :lo]] = float("nan")
        pool_v[slots[r, :lo]] = float("nan")
    q = torch.randn(sum(lens), heads, group, dim)
    q_start = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)
    layout = cpu_kernels.extend_layout(slots, q_start, torch.tensor(prefix, dtype=torch.int64), len(pool_k))
    got = kernel.extend_attention(q, pool_k, pool_v, layout, dim ** -0.5, window=window)
    outs, start = [], 0
    for r, (n, p) in enumerate(zip(lens, prefix)):
        qb = q[start:start + n].permute(1, 2, 0, 3)  # [H, G, n, D]
        i, j = torch.arange(n)[:, None] + p, torch.arange(p + n)[None, :]
        mask = torch.zeros(n, p + n).masked_fill_((j > i) | (j <= i - window), float("-inf"))
        k_r = kt[r, :, None, :, :p + n].transpose(-1, -2).nan_to_num(0.0)
        v_r = v[r, :, None, :p + n]
        outs.append(F.scaled_dot_product_attention(qb, k_r, v_r, attn_mask=mask, scale=dim ** -0.5)
                    .permute(2, 0, 1, 3))
        start += n
    torch.testing.assert_close(got, torch.cat(outs), rtol=1e-5, atol=1e-5)


def test_extend_layout_refuses_keys_past_the_slots() -> None:
    q_start = torch.tensor([0, 4], dtype=torch.int64)
    with pytest.raises(AssertionError):  # 5 cached + 4 new > 8 slots
        cpu_kernels.extend_layout(torch.zeros(1, 8, dtype=torch.int64), q_start, torch.tensor([5]), 16)
    with pytest.raises(AssertionError):  # a slot past the pool
        cpu_kernels.extend_layout(torch.full((1, 9), 16, dtype=torch.int64), q_start, torch.tensor([5]), 16)
    cpu_kernels.extend_layout(torch.full((1, 9), 15, dtype=torch.int64), q_start, torch.tensor([5]), 16)


@pytest.mark.parametrize("rows", [3, 200])  # one thread, and rows split over threads
def test_rope_rotates_in_place_like_the_torch_path(kernel, threads: int, rows: int) -> None:
    torch.manual_seed(rows)
    for partial in (1.0, 0.5):  # the whole head, and the first half of it
        cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": partial})
        rope = RotaryEmbedding(cfg, 64, 512, torch.device("cpu"), torch.float32)
        assert rope.rot_dim == int(64 * partial)
        qkv = torch.randn(rows, 7 * 64)  # q and k heads (5) rotate; the last two heads (v) must not
        x = qkv[:, :5 * 64].view(rows, 5, 64)
        positions = torch.randint(0, 512, (rows,))
        want = rope.apply(x.clone(), rope.prepare(positions))
        v_before = qkv[:, 5 * 64:].clone()
        rope.native = kernel
        assert rope.apply(x, rope.prepare(positions)) is x
        torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(qkv[:, 5 * 64:], v_before)


@pytest.mark.parametrize("rows", [1, 100])
def test_silu_mul_matches_torch(kernel, threads: int, rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 96) * 4
    want = F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    torch.testing.assert_close(kernel.silu_mul(gate_up), want, rtol=1e-5, atol=1e-5)


def test_loading_it_leaves_subnormals_alone(kernel) -> None:
    # -ffast-math at link time would add crtfastmath.o, which sets flush-to-zero process-wide.
    smallest_normal = sys.float_info.min
    assert smallest_normal / 2 > 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0


def test_layout_refuses_what_the_buffers_cannot_hold() -> None:
    lens = torch.tensor([3, 4])
    with pytest.raises(AssertionError):
        cpu_kernels.decode_layout(torch.tensor([3, 9]), 8)  # past the buffer
    with pytest.raises(AssertionError):
        cpu_kernels.decode_layout(torch.tensor([0, 4]), 8)  # a row with no key
    with pytest.raises(AssertionError):
        cpu_kernels.decode_layout(lens, 8, rows=torch.tensor([0, 2]))  # no dense row 2
    with pytest.raises(AssertionError):
        cpu_kernels.decode_layout(lens, 8, new_pos=torch.tensor([0, 8]))
    with pytest.raises(AssertionError):
        cpu_kernels.decode_layout(lens, 8, loc=torch.tensor([5, 100]), pool_size=100)
    with pytest.raises(AssertionError):  # entry 1 of one
        cpu_kernels.decode_layout(lens, 8, entry=torch.tensor([1, -1]), plen=torch.tensor([2, 0]), p_cap=4,
                                  entries=1)
    cpu_kernels.decode_layout(lens, 8, entry=torch.tensor([0, -1]), plen=torch.tensor([2, 0]), p_cap=4, entries=1)


def test_refuses_queries_whose_heads_are_not_contiguous(kernel) -> None:
    kt, v = torch.zeros(2, 2, 32, 64), torch.zeros(2, 2, 64, 32)
    layout = cpu_kernels.decode_layout(torch.tensor([3, 4]), 64)
    q = torch.zeros(2, 32, 1, 2).permute(0, 3, 2, 1)  # [B, H, G, D] with D strided
    with pytest.raises(AssertionError):
        kernel.decode_attention(q, kt, v, layout, 1.0)
    kernel.decode_attention(q.contiguous(), kt, v, layout, 1.0)


@pytest.mark.parametrize("with_pool", [True, False])
def test_decode_writes_the_new_kv_into_pool_slots_and_dense_rows(kernel, threads: int, with_pool: bool) -> None:
    """What index_copy_ into the pool and the dense cache's advanced-index put would write, and the
    attention over rows that hold the new key (the store and the read are one pass)."""
    torch.manual_seed(5)
    b, heads, group, dim, l_cap = 3, 4, 2, 32, 64
    qkv = torch.randn(b, (group + 2) * heads * dim)  # strided views into one output, as in a layer
    q = qkv[:, :group * heads * dim].view(b, heads, group, dim)
    k = qkv[:, group * heads * dim:(group + 1) * heads * dim].view(b, heads, dim)
    v = qkv[:, (group + 1) * heads * dim:].view(b, heads, dim)
    pool_k, pool_v = torch.zeros(10, heads, dim), torch.zeros(10, heads, dim)
    kt_buf, v_buf = torch.randn(5, heads, dim, l_cap), torch.randn(5, heads, l_cap, dim)
    rows, new_pos, loc = torch.tensor([3, 0, 4]), torch.tensor([7, 0, 63]), torch.tensor([9, 2, 5])
    lens = torch.tensor([1, 1, 1, 8, 64])
    want_kt, want_v = kt_buf.clone(), v_buf.clone()  # K^T in position order
    kt_buf = blocked_kt(kt_buf)
    want_kt[rows, :, :, new_pos] = k
    want_v[rows, :, new_pos] = v
    layout = cpu_kernels.decode_layout(lens, l_cap, rows, new_pos, loc, 10)
    got = kernel.decode_attention(q, kt_buf, v_buf, layout, dim ** -0.5, new_kv=(k, v),
                                  pool=(pool_k, pool_v) if with_pool else None)
    assert torch.equal(kt_positions(kt_buf), want_kt) and torch.equal(v_buf, want_v)
    want_pool_k, want_pool_v = torch.zeros_like(pool_k), torch.zeros_like(pool_v)
    if with_pool:
        want_pool_k.index_copy_(0, loc, k)
        want_pool_v.index_copy_(0, loc, v)
    assert torch.equal(pool_k, want_pool_k) and torch.equal(pool_v, want_pool_v)
    want = reference(q.contiguous(), want_kt[rows], want_v[rows], lens[rows], dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):  # the pool is written with the new K/V only
        kernel.decode_attention(q, kt_buf, v_buf, layout, dim ** -0.5, pool=(pool_k, pool_v))


@pytest.mark.parametrize("heads,dim", [(3, 64), (2, 32)])
def test_fill_rows_copies_pool_slots_into_dense_rows(kernel, threads: int, heads: int, dim: int) -> None:
    """What the torch fill (index_select, then a permuted copy per request) writes; the rest untouched."""
    torch.manual_seed(heads * dim)
    pool_k, pool_v = torch.randn(50, heads, dim), torch.randn(50, heads, dim)
    kt_buf, v_buf = torch.randn(6, heads, dim, 128), torch.randn(6, heads, 128, dim)
    want_kt, want_v = kt_positions(kt_buf), v_buf.clone()
    joins = [(4, torch.randperm(50)[:37]), (0, torch.tensor([3])), (2, torch.randperm(50)[:50]),
             (5, torch.tensor([], dtype=torch.int64))]
    for row, slots in joins:
        want_kt[row, :, :, :len(slots)] = pool_k[slots].permute(1, 2, 0)
        want_v[row, :, :len(slots)] = pool_v[slots].transpose(0, 1)
    start = torch.tensor([0] + list(itertools.accumulate(len(s) for _, s in joins)))
    kernel.fill_rows((pool_k, pool_v), torch.cat([s for _, s in joins]), start,
                     torch.tensor([r for r, _ in joins]), kt_buf, v_buf)
    assert torch.equal(kt_positions(kt_buf), want_kt) and torch.equal(v_buf, want_v)
    with pytest.raises(AssertionError):  # a slot past the pool
        kernel.fill_rows((pool_k, pool_v), torch.tensor([50]), torch.tensor([0, 1]), torch.tensor([0]),
                         kt_buf, v_buf)
    with pytest.raises(AssertionError):  # more keys than a row holds
        kernel.fill_rows((pool_k, pool_v), torch.zeros(129, dtype=torch.int64), torch.tensor([0, 129]),
                         torch.tensor([0]), kt_buf, v_buf)


NARROW_KV = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def widened(t: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """t rounded to `dtype` (a KV buffer the kernels read in it) and the same values in float32."""
    narrow = to_kv(t, dtype)
    return narrow, narrow.float()


Pair = tuple[torch.Tensor, torch.Tensor]


def pooled_extend(lens: list[int], prefix: list[int], heads: int, group: int, dim: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, Pair, Pair, cpu_kernels.ExtendLayout]:
    """An extend batch: request b's lens[b] new tokens after prefix[b] cached ones, every key in a pool of
    `dtype` at random slots, the same values in float32 beside it; q [T, heads, group, dim]. Returns q,
    (pool_k, pool_v), their float32 values and the layout."""
    l_cap = max(n + p for n, p in zip(lens, prefix)) + 3
    kt, v = torch.randn(len(lens), heads, dim, l_cap), torch.randn(len(lens), heads, l_cap, dim)
    pool_k, pool_v, slots = pooled(kt, v, [n + p for n, p in zip(lens, prefix)])
    (pool_k, k32), (pool_v, v32) = widened(pool_k, dtype), widened(pool_v, dtype)
    q = torch.randn(sum(lens), heads, group, dim)
    q_start = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)
    layout = cpu_kernels.extend_layout(slots, q_start, torch.tensor(prefix, dtype=torch.int64), len(pool_k))
    return q, (pool_k, pool_v), (k32, v32), layout


@pytest.mark.parametrize("dtype", NARROW_KV, ids=str)
def test_fp8_codecs_are_torchs_conversions(kernel, dtype: torch.dtype) -> None:
    """The kernels' fp8 reading of all 256 codes is torch's (an E4M3 NaN code reads as 480: the kernels
    never restore it), and their stores are torch's conversion of the value saturated at the largest
    finite one, bit for bit: subnormals, ties, overflow, infinities, NaN."""
    if dtype == torch.bfloat16:
        pytest.skip("bf16 is a shift: covered by the attention tests")
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    got, want = kernel.fp8_values(codes), codes.float()
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite])
    if dtype == torch.float8_e4m3fn:
        assert got[~finite].tolist() == [480.0, -480.0]
    else:
        assert torch.equal(got[~finite].isnan(), want[~finite].isnan())
    torch.manual_seed(5)
    x = torch.cat([torch.randn(20_000) * s for s in (1e-5, 3e-3, 1.0, 40.0, 1e4)] + [
        torch.tensor([0.0, -0.0, 1e9, -1e9, float("inf"), float("-inf"), float("nan")]),
        want[finite] * 1.0625, (want[finite][1:] + want[finite][:-1]) / 2])  # between codes: ties
    assert torch.equal(bits(kernel.fp8_codes(x, dtype)), bits(to_kv(x, dtype)))
    assert to_kv(torch.tensor([1e9]), dtype).float().item() == FP8_MAX[dtype]


@pytest.mark.parametrize("dtype", NARROW_KV, ids=str)
@pytest.mark.parametrize("heads,group,dim", [(4, 2, 32), (2, 3, 64), (1, 6, 64), (1, 4, 128), (1, 12, 32)])
@pytest.mark.parametrize("window", [0, 9])
def test_decode_over_narrow_kv_is_the_float32_kernel_on_the_rounded_keys(kernel, threads: int, heads: int,
                                                                         group: int, dim: int, window: int,
                                                                         dtype: torch.dtype) -> None:
    """bf16 or fp8 dense rows, shared prefixes and pool: the step's new K/V are stored rounded to nearest
    even (torch's own conversion, fp8 saturated, bit for bit), and the attention equals the float32
    kernel's over the same values widened to float32. With AVX-512 the bf16 reads take the intrinsics
    (32 keys a load; a row's last block masked where it ends past the buffer; 64 or 32 keys a block by
    the group), fp8 ones likewise 16 a load, the float32 ones the portable loops: these shapes cover
    both block widths and the fallbacks (group 12; fp8 values over 5 x 16 accumulators)."""
    torch.manual_seed(heads * 100 + group * 10 + dim + window)
    b, l_cap, p_cap, slots = 4, 128, 48, 30
    lens = torch.tensor([70, 3, 45, 60], dtype=torch.int64)
    entry = torch.tensor([0, -1, 0, 1], dtype=torch.int64)
    plen = torch.tensor([40, 0, 40, 17], dtype=torch.int64)
    rows, new_pos, loc = torch.tensor([2, 0, 3, 1]), torch.tensor([2, 29, 19, 42]), torch.tensor([9, 2, 5, 29])
    kt, kt32 = widened(torch.randn(b, heads, dim, l_cap), dtype)
    kt, kt32 = blocked_kt(kt), blocked_kt(kt32)
    v, v32 = widened(torch.randn(b, heads, l_cap, dim), dtype)
    # the prefix copies hold the same values in prefix_dtype (bf16 for fp8)
    pk, pk32 = widened(torch.randn(2, heads, dim, p_cap), dtype)
    pv, pv32 = widened(torch.randn(2, heads, p_cap, dim), dtype)
    pk, pv = pk.to(cpu_kernels.prefix_dtype(dtype)), pv.to(cpu_kernels.prefix_dtype(dtype))
    pool_k, pool_v = torch.zeros(slots, heads, dim, dtype=dtype), torch.zeros(slots, heads, dim, dtype=dtype)
    pool_k32, pool_v32 = pool_k.float(), pool_v.float()
    q = torch.randn(b, heads, group, dim)
    k_new, v_new = torch.randn(b, heads, dim), torch.randn(b, heads, dim)
    layout = cpu_kernels.decode_layout(lens, l_cap, rows, new_pos, loc, slots, entry, plen, p_cap, 2)
    got = kernel.decode_attention(q, kt, v, layout, dim ** -0.5, (pk, pv), window=window or None,
                                  new_kv=(k_new, v_new), pool=(pool_k, pool_v))
    k_half, v_half = to_kv(k_new, dtype), to_kv(v_new, dtype)
    assert torch.equal(bits(kt_positions(kt)[rows, :, :, new_pos]), bits(k_half))
    assert torch.equal(bits(v[rows, :, new_pos]), bits(v_half))
    assert torch.equal(bits(pool_k[loc]), bits(k_half)) and torch.equal(bits(pool_v[loc]), bits(v_half))
    want = kernel.decode_attention(q, kt32, v32, layout, dim ** -0.5, (pk32, pv32), window=window or None,
                                   new_kv=(k_half.float(), v_half.float()), pool=(pool_k32, pool_v32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(kt.float(), kt32) and torch.equal(pool_k.float(), pool_k32)
    with pytest.raises(AssertionError):  # one KV dtype for rows and pool, its prefix_dtype for the prefixes
        kernel.decode_attention(q, kt, v, layout, dim ** -0.5, (pk32, pv32))
    if dtype != torch.bfloat16:
        with pytest.raises(AssertionError):
            kernel.decode_attention(q, kt, v, layout, dim ** -0.5, (pk.to(dtype), pv.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, *NARROW_KV], ids=str)
@pytest.mark.parametrize("group", [1, 3, 12])
@pytest.mark.parametrize("window", [0, 45, 101])
def test_decode_reads_blocked_rows_across_block_ends(kernel, threads: int, dtype: torch.dtype, group: int,
                                                     window: int) -> None:
    """The rows' K^T in blocks of KT_BLOCK positions: rows that end inside a block, keys that run across
    block ends and windows that start inside one (a vector of 32 or 16 keys then loads as two masked
    halves), on every read path (float32's portable loops, bf16's and fp8's intrinsics, group 12's
    portable ones), against attention over the same values in position order."""
    torch.manual_seed(group * 1000 + window)
    b, heads, dim, l_cap = 4, 2, 64, 192
    lens = torch.tensor([191, 130, 65, 100], dtype=torch.int64)
    kt, v = torch.randn(b, heads, dim, l_cap), torch.randn(b, heads, l_cap, dim)
    if dtype != torch.float32:
        kt, v = to_kv(kt, dtype), to_kv(v, dtype)
    kt32, v32 = kt.float(), v.float()
    q = torch.randn(b, heads, group, dim)
    got = kernel.decode_attention(q, blocked_kt(kt), v, cpu_kernels.decode_layout(lens, l_cap), dim ** -0.5,
                                  window=window or None)
    want = torch.empty_like(q)
    for r, n in enumerate(lens.tolist()):
        lo = max(0, n - window) if window else 0
        want[r] = ((q[r] @ kt32[r, :, :, lo:n]) * dim ** -0.5).softmax(-1) @ v32[r, :, lo:n]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", NARROW_KV, ids=str)
@pytest.mark.parametrize("heads,group,dim", [(4, 2, 32), (1, 4, 128), (1, 12, 32), (2, 3, 40)])
def test_extend_over_a_narrow_pool_is_the_float32_kernel_on_the_rounded_keys(kernel, threads: int, heads: int,
                                                                             group: int, dim: int,
                                                                             dtype: torch.dtype) -> None:
    """A bf16 or fp8 pool widened into the float32 tiles (fp8 rows 16 values at a time where the CPU
    has AVX-512, a head_dim that is no multiple of 16 ends in the portable loop)."""
    torch.manual_seed(heads + group + dim)
    q, (pool_k, pool_v), (pool_k32, pool_v32), layout = pooled_extend([1, 40, 5, 17, 9], [0, 0, 33, 2, 20],
                                                                      heads, group, dim, dtype)
    for window in (None, 6):
        got = kernel.extend_attention(q, pool_k, pool_v, layout, dim ** -0.5, window=window, tiles=False)
        want = kernel.extend_attention(q, pool_k32, pool_v32, layout, dim ** -0.5, window=window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", NARROW_KV, ids=str)
@pytest.mark.parametrize("heads,group,dim", [(3, 3, 64), (2, 1, 32), (1, 5, 128)])
@pytest.mark.parametrize("lens,prefix", [([1, 70, 5, 17, 40, 3], [0, 0, 33, 2, 90, 130]),  # many requests
                                         ([700], [0]), ([600, 333], [0, 41])],  # a few: rows cut into runs
                         ids=["many", "one", "two"])
def test_extend_on_tiles_matches_the_float32_kernel(kernel, threads: int, heads: int, group: int, dim: int,
                                                    dtype: torch.dtype, lens: list[int], prefix: list[int]) -> None:
    """Prefill on AMX tiles over a bf16 or fp8 pool (q and the probabilities rounded to bf16 for the
    products) against the float32 kernel on the same keys: within bf16's rounding, for requests of one to
    many query tiles, after cached prefixes, with a window that starts past the first 32 keys; a request
    alone or one of two, long enough that its query rows are cut into runs of their own tasks."""
    if not kernel.tiles_for(dtype, dim):
        pytest.skip("no AMX-BF16 tiles on this CPU")
    torch.manual_seed(heads + group + dim)
    q, (pool_k, pool_v), _, layout = pooled_extend(lens, prefix, heads, group, dim, dtype)
    for window in (None, 6, 50):
        got = kernel.extend_attention(q, pool_k, pool_v, layout, dim ** -0.5, window=window, tiles=True)
        want = kernel.extend_attention(q, pool_k, pool_v, layout, dim ** -0.5, window=window, tiles=False)
        assert got.isfinite().all()
        assert float((got - want).norm() / want.norm()) < 1e-2, window
        torch.testing.assert_close(got, want, rtol=0.0, atol=3e-2)


@pytest.mark.parametrize("dtype", NARROW_KV[1:], ids=str)
def test_extend_on_tiles_over_fp8_is_the_bf16_pool_of_the_same_values(kernel, threads: int,
                                                                      dtype: torch.dtype) -> None:
    """Every fp8 value is a bf16 one, and the tiles take bf16: an fp8 pool's rows, widened as they are
    gathered (16 positions at a time, then the last few one by one), give the same bits as a bf16 pool
    holding the same values."""
    heads, group, dim = 3, 3, 64
    if not kernel.tiles_for(dtype, dim):
        pytest.skip("no AMX-BF16 tiles on this CPU")
    torch.manual_seed(11)
    q, (pool_k, pool_v), (k32, v32), layout = pooled_extend([300, 37, 5], [0, 19, 70], heads, group, dim, dtype)
    for window in (None, 50):
        got = kernel.extend_attention(q, pool_k, pool_v, layout, dim ** -0.5, window=window, tiles=True)
        want = kernel.extend_attention(q, k32.to(torch.bfloat16), v32.to(torch.bfloat16), layout, dim ** -0.5,
                                       window=window, tiles=True)
        assert torch.equal(got, want), window


@pytest.mark.parametrize("tiles", [False, True], ids=["rows", "tiles"])
def test_extend_reads_queries_at_their_row_stride(kernel, threads: int, tiles: bool) -> None:
    """q as the model hands it over, a view of the rotated q/k rows ([T, Hq + Hkv, D], keys after the
    queries): the same result as from a contiguous copy."""
    dtype = torch.bfloat16 if tiles else torch.float32
    heads, group, dim = 3, 3, 64
    if tiles and not kernel.tiles_for(dtype, dim):
        pytest.skip("no AMX-BF16 tiles on this CPU")
    torch.manual_seed(5)
    lens, prefix = [300, 7, 40], [0, 20, 3]
    l_cap = max(n + p for n, p in zip(lens, prefix)) + 3
    kt, v = torch.randn(len(lens), heads, dim, l_cap), torch.randn(len(lens), heads, l_cap, dim)
    pool_k, pool_v, slots = pooled(kt, v, [n + p for n, p in zip(lens, prefix)])
    pool_k, pool_v = pool_k.to(dtype), pool_v.to(dtype)
    qk = torch.randn(sum(lens), heads * group + heads, dim)
    q = qk[:, : heads * group].reshape(sum(lens), heads, group, dim)  # rows (Hq + Hkv) * D floats apart
    assert not q.is_contiguous()
    q_start = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)
    layout = cpu_kernels.extend_layout(slots, q_start, torch.tensor(prefix, dtype=torch.int64), len(pool_k))
    got = kernel.extend_attention(q, pool_k, pool_v, layout, dim ** -0.5, tiles=tiles)
    want = kernel.extend_attention(q.contiguous(), pool_k, pool_v, layout, dim ** -0.5, tiles=tiles)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", cpu_kernels.KV_DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [5, 200], ids=["few", "many"])  # one thread, or split over them
def test_store_kv_writes_the_pools_bits(kernel, threads: int, dtype: torch.dtype, tokens: int) -> None:
    """The new tokens' K/V (views of the qkv rows, as the model hands them over) into their pool slots:
    the same bits as TokenToKVPool.set_kv_buffer (saturated fp8, nearest-even bf16), other slots untouched."""
    from services.scheduler.kvcache.memory_pool import TokenToKVPool

    torch.manual_seed(tokens)
    heads, dim = 3, 64
    pools = [TokenToKVPool(400, 1, heads, dim, dtype, torch.device("cpu")) for _ in range(2)]
    for pool in pools:  # the same filler in both, so untouched slots compare equal too
        for buf in (pool.k_buffer[0], pool.v_buffer[0]):
            bits(buf).copy_(bits(to_kv(torch.full(buf.shape, 3.0), dtype)))
    qkv = torch.randn(tokens, 5 * heads, dim) * 300  # past fp8's range: the saturation is checked too
    qkv[0, 3 * heads, :4] = torch.tensor([float("inf"), -float("inf"), 1e-9, -0.0])
    k, v = qkv[:, 3 * heads: 4 * heads], qkv[:, 4 * heads:]
    loc = torch.randperm(400)[:tokens] + 1
    pools[0].set_kv_buffer(0, loc, k, v)
    kernel.store_kv(pools[1].k_buffer[0], pools[1].v_buffer[0], loc, k, v)
    for a, b in ((pools[0].k_buffer[0], pools[1].k_buffer[0]), (pools[0].v_buffer[0], pools[1].v_buffer[0])):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", NARROW_KV, ids=str)
def test_fill_rows_copies_narrow_slots_bit_for_bit(kernel, threads: int, dtype: torch.dtype) -> None:
    torch.manual_seed(11)
    heads, dim = 2, 64
    pool_k, pool_v = to_kv(torch.randn(50, heads, dim), dtype), to_kv(torch.randn(50, heads, dim), dtype)
    bits(pool_k)[7, 0, 3] = bits(to_kv(torch.tensor([float("nan")]), dtype))[0]
    kt_buf, v_buf = torch.zeros(3, heads, dim, 64, dtype=dtype), torch.zeros(3, heads, 64, dim, dtype=dtype)
    slots = torch.randperm(50)[:33]
    kernel.fill_rows((pool_k, pool_v), slots, torch.tensor([0, 33]), torch.tensor([1]), kt_buf, v_buf)
    assert torch.equal(bits(kt_positions(kt_buf)[1, :, :, :33]), bits(pool_k[slots].permute(1, 2, 0).contiguous()))
    assert torch.equal(bits(v_buf[1, :, :33]), bits(pool_v[slots].transpose(0, 1).contiguous()))
    with pytest.raises(AssertionError):  # rows of another dtype than the pool
        kernel.fill_rows((pool_k, pool_v), slots, torch.tensor([0, 33]), torch.tensor([1]), kt_buf.float(),
                         v_buf.float())


@pytest.mark.parametrize("rows", [1, 3, 200])
def test_add_rms_norm_is_the_residual_add_then_the_norm(kernel, threads: int, rows: int) -> None:
    torch.manual_seed(rows)
    n = 256
    x = torch.randn(rows, n) * 3
    delta = torch.randn(rows, n + 64)[:, :n]  # a strided view, as an o_proj output is not
    weight, eps = torch.randn(n), 1e-6
    summed = x + delta
    # HF's LlamaRMSNorm, step by step
    want = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps))
    got = kernel.add_rms_norm(x, delta, weight, eps)
    assert torch.equal(x, summed)  # the residual stream, updated in place
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(kernel.add_rms_norm(x.clone(), None, weight, eps),
                               F.rms_norm(summed, (n,), weight, eps), rtol=2e-6, atol=2e-6)


SPECIALS = [float("nan"), float("inf"), -float("inf"), 1e-40, -0.0, 3.0000002, 65504.5, 1.00390625]


@pytest.mark.parametrize("rows", [1, 3, 200])
def test_bf16_sides_of_the_gate_and_the_norm_are_torch_conversions(kernel, threads: int, rows: int) -> None:
    """Reading a bf16 GEMM output and writing a bf16 GEMM input: the same bits as .float() before and
    .to(torch.bfloat16) after the float32 kernel (round to nearest even, NaN stays NaN)."""
    torch.manual_seed(rows)
    n = 256
    for inter in (100, 192):  # a short last chunk and rows at odd offsets; whole chunks only
        gate_up = (torch.randn(rows, 2 * inter) * 4).bfloat16()
        gate_up[0, :len(SPECIALS)] = torch.tensor(SPECIALS)
        plain = kernel.silu_mul(gate_up.float())
        for out in (torch.float32, torch.bfloat16):
            assert same_bits(kernel.silu_mul(gate_up, out), plain.to(out))
        assert same_bits(kernel.silu_mul(gate_up.float(), torch.bfloat16), plain.bfloat16())
        want = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
        k = len(SPECIALS)  # past the specials, where torch's silu and the formula part at infinities
        torch.testing.assert_close(plain[:, k:], want[:, k:], rtol=1e-5, atol=1e-5)
    x = torch.randn(rows, n) * 3
    delta = (torch.randn(rows, n + 64)[:, :n] * 2).bfloat16()  # strided, as a fused output's slice is
    weight = torch.randn(n)
    x_want = x.clone()
    want = kernel.add_rms_norm(x_want, delta.float(), weight, 1e-6).bfloat16()
    got = kernel.add_rms_norm(x, delta, weight, 1e-6, torch.bfloat16)
    assert torch.equal(x, x_want) and same_bits(got, want)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtypes, NaN where the other is NaN (torch's own conversions disagree on its bits), and
    equal bits everywhere else (-0.0 apart from 0.0, which torch.equal does not tell)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    nan = a.isnan()
    return (a.dtype == b.dtype and torch.equal(nan, b.isnan())
            and torch.equal(a.view(ints[a.dtype])[~nan], b.view(ints[b.dtype])[~nan]))


def test_argmax_picks_what_torch_picks(kernel) -> None:
    torch.manual_seed(11)
    logits = torch.randn(6, 4096)
    logits[1, 100] = logits[1, 3000] = 50.0       # a tie: the first
    logits[2, :] = 0.0
    logits[2, 4095] = -0.0
    logits[3, 7] = float("nan")                  # NaN wins, as in torch
    logits[4, 4000] = float("inf")
    logits[5, 0] = 1e30
    assert kernel.argmax(logits) == logits.argmax(-1).tolist()
    assert kernel.argmax(logits[:, :1000]) == logits[:, :1000].argmax(-1).tolist()  # strided rows
    # a decode batch over a real vocabulary: rows split over the threads, each with its own ties and NaNs
    big = torch.randn(64, 49152)
    big[::3, 17] = big[::3, 40000] = 60.0
    big[5::7, 123] = float("nan")
    big[6::9, 49151] = float("inf")
    assert kernel.argmax(big) == big.argmax(-1).tolist()
    assert kernel.argmax(big[:, :30000]) == big[:, :30000].argmax(-1).tolist()


@pytest.mark.parametrize("rows,n,k", [(1, 96, 64), (3, 33, 48), (7, 130, 1536), (8, 17, 40), (19, 64, 576)])
def test_linear_over_bf16_weights_is_the_product_of_the_rounded_operands(kernel, threads: int, rows: int, n: int,
                                                                          k: int) -> None:
    """Any row count (8 at a time, the rest one size down), any K (a last part shorter than a cache
    line of weights), odd N (the last weight row alone); float32 sums of the bf16-rounded x and W."""
    torch.manual_seed(rows * n + k)
    w = (torch.randn(n, k) * 0.1).bfloat16()
    x = torch.randn(rows, k + 5)[:, :k]  # rows at a stride, as a slice of a wider activation
    want = x.bfloat16().double() @ w.double().T
    got = kernel.linear_bf16w(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # ... and the input is rounded: the float32 x would differ by far more than the sums' rounding.
    assert (got.double() - x.double() @ w.double().T).abs().max() > 1e-4
    with pytest.raises(AssertionError):  # float32 weights: not this kernel's
        kernel.linear_bf16w(x, w.float())


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("n,k", [(96, 64), (32, 1536)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tile_gemm_is_the_rounded_product_of_the_rounded_operands(kernel, threads: int, rows: int, n: int, k: int,
                                                                  x_dtype: torch.dtype) -> None:
    """Rows in tiles of 16 (a last one part padding, a lone second one), x float32 or bf16 at a stride: the
    float32 sums of the bf16-rounded x and W, rounded to bf16 in either output dtype (the same values)."""
    if not kernel.tiles:
        pytest.skip("no AMX tiles on this CPU")
    torch.manual_seed(rows * n + k)
    w = (torch.randn(n, k) * 0.1).bfloat16()
    x = torch.randn(rows, k + 32)[:, :k].to(x_dtype)  # rows at a stride, as a slice of a wider activation
    wp = kernel.pack_tiles(w)
    assert wp is not None and wp.numel() == n * k
    want = x.bfloat16().double() @ w.double().T
    got = kernel.linear_tiles(x, wp)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert torch.equal(got, got.bfloat16().float())  # bf16 values, as the packed bf16 GEMM gives
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-5)  # half a bf16 step
    assert torch.equal(kernel.linear_tiles(x, wp, torch.bfloat16).float(), got)
    if x_dtype == torch.float32:  # the input is rounded: the float32 x gives another product
        assert (got.double() - x.double() @ w.double().T).abs().max() > 1e-3


@pytest.mark.parametrize("rows", [1, 8, 17, 33, 64])
@pytest.mark.parametrize("n", [64, 96, 4096])
def test_tile_gemm_argmax_is_the_argmax_of_its_output(kernel, threads: int, rows: int, n: int) -> None:
    """Greedy decoding's fused lm_head picks what argmax() picks on linear_tiles' output: the first maximum
    of the bf16-rounded sums (rounding makes ties common: x and W of few distinct values make many), the
    first NaN on a row that has one, the first column on a row of -inf; the columns split over the threads
    (n: 2, 3 or 128 pairs of blocks, so a thread may have none)."""
    if not kernel.tiles:
        pytest.skip("no AMX tiles on this CPU")
    torch.manual_seed(rows * n)
    k = 64
    w = torch.randint(-2, 3, (n, k)).bfloat16()
    x = torch.randint(-2, 3, (rows, k + 32))[:, :k].float()  # rows at a stride
    x[0, :] = 0.0  # a row of zeros: every column ties, the answer is 0
    w[n // 2, :] = float("inf")
    if rows > 2:
        x[1, :] = 1.0  # + inf at column n / 2 (and NaN where inf meets -inf in a sum: none, W's row is all inf)
        x[2, 0] = float("nan")  # a NaN row: every sum NaN, the first NaN is column 0
    if rows > 5:
        x[5, :] = -1.0  # -inf at column n / 2
    wp = kernel.pack_tiles(w)
    assert wp is not None
    logits = kernel.linear_tiles(x, wp)
    want = kernel.argmax(logits)
    assert want == logits.argmax(-1).tolist()
    assert kernel.linear_tiles_argmax(x, wp).tolist() == want
    assert kernel.linear_tiles_argmax(x.bfloat16(), wp).tolist() == want
    # Columns that hold NaN, all but the first, on a row of ordinary values; a row of -inf only.
    w2 = w.clone()
    w2[n // 2, :] = 1.0
    w2[n - 1, 0] = float("nan")
    w2[n // 3, 0] = float("nan")
    x2 = x.clone()
    x2[0, :] = 1.0
    wp2 = kernel.pack_tiles(w2)
    assert wp2 is not None
    logits2 = kernel.linear_tiles(x2, wp2)
    assert kernel.linear_tiles_argmax(x2, wp2).tolist() == logits2.argmax(-1).tolist()
    w3 = torch.full((n, k), float("-inf")).bfloat16()
    wp3 = kernel.pack_tiles(w3)
    assert wp3 is not None
    x3 = torch.ones(rows, k)
    assert kernel.linear_tiles_argmax(x3, wp3).tolist() == [0] * rows


def test_tile_gemm_takes_only_multiples_of_32(kernel) -> None:
    if not kernel.tiles:
        pytest.skip("no AMX tiles on this CPU")
    for n, k in ((48, 64), (64, 48), (16, 32)):
        assert kernel.pack_tiles(torch.zeros(n, k, dtype=torch.bfloat16)) is None


def test_linear_over_bf16_weights_without_avx512_bf16_computes_the_same(tmp_path: Path, monkeypatch) -> None:
    """The portable path (widened weights, float32 FMAs), built here with AVX512-BF16 off, against the
    same reference: CPUs without it run this one."""
    from services.scheduler.kernels import kernel_build

    monkeypatch.setattr(kernel_build, "CFLAGS", [*kernel_build.CFLAGS, "-mno-avx512bf16"])
    path = kernel_build.build((Path(cpu_kernels.__file__).parent / "csrc" / "linear.c",), cache=str(tmp_path))
    if path is None:
        pytest.skip("no C compiler on this machine")
    fn = ctypes.CDLL(str(path)).linear_bf16w_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    torch.manual_seed(5)
    for rows, n, k in ((1, 96, 64), (11, 33, 40)):
        w, x = (torch.randn(n, k) * 0.1).bfloat16(), torch.randn(rows, k)
        out = torch.empty(rows, n)
        assert fn(x.data_ptr(), k, rows, w.data_ptr(), n, k, out.data_ptr(), 2) == 0
        torch.testing.assert_close(out.double(), x.bfloat16().double() @ w.double().T, rtol=1e-5, atol=1e-5)
