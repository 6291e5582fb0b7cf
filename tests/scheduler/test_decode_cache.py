"""The dense decode cache gives the same logits as gathering the pool, as the batch changes."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.kernels.cpu_kernels import prefix_dtype
from services.scheduler.model_executor.forward_batch import ForwardMode
from services.scheduler.model_executor.model_runner import ModelRunner, kv_cache_dtype_name
from tests.scheduler.test_model_runner import Seq, make_batch


@pytest.fixture(scope="module")
def runner(model_dir: str) -> ModelRunner:
    return ModelRunner(model_dir, device="cpu", max_total_tokens=4096, max_running_requests=16)


def decode(runner: ModelRunner, seqs: list[Seq], dense: bool) -> torch.Tensor:
    """One decode step; without `dense` the backend gathers the pool as on CUDA."""
    backend = runner.attn_backend
    saved = backend.dense
    if not dense:
        backend.dense = None
    try:
        for s in seqs:
            s.ids.append(len(s.ids) % 4000 + 7)  # the "sampled" token
        return runner.forward(make_batch(seqs, ForwardMode.DECODE, [1] * len(seqs)))
    finally:
        backend.dense = saved


def test_dense_rows_follow_joins_leaves_and_reuse(runner: ModelRunner) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = [Seq(runner, torch.randint(0, 4000, (n,), generator=g).tolist()) for n in (9, 30, 4, 17)]
    runner.forward(make_batch(seqs, ForwardMode.EXTEND, [len(s.ids) for s in seqs]))
    twins = []  # the same sequences replayed through the gather path, on their own rows
    for s in seqs:
        t = Seq(runner, s.ids)
        runner.forward(make_batch([t], ForwardMode.EXTEND, [len(t.ids)]))
        twins.append(t)

    def step(active: list[int]) -> list[int]:
        """One decode step of `active`; returns each one's dense row."""
        dense = decode(runner, [seqs[i] for i in active], dense=True)
        gathered = decode(runner, [twins[i] for i in active], dense=False)
        torch.testing.assert_close(dense, gathered, atol=1e-5, rtol=1e-5)
        cache = runner.attn_backend.dense
        rows = [cache.row_of[seqs[i].row] for i in active]
        assert len(set(rows)) == len(active) and [cache.req_at[r] for r in rows] == [seqs[i].row for i in active]
        assert sorted(cache.holes) == [r for r in range(len(cache.req_at)) if r not in rows]
        return rows

    assert step([0, 1, 2, 3]) == [0, 1, 2, 3]
    step([0, 1, 2, 3])
    assert step([0, 2, 3]) == [0, 2, 3]  # a request in the middle leaves: its row is a hole, nothing moves
    assert step([3, 0]) == [3, 0]        # another leaves, order changes
    assert step([3, 0, 1]) == [3, 0, 1]  # one comes back, refilled from the pool into the lowest hole
    assert step([0, 1]) == [0, 1]        # the last row leaves: the holes at the end are dropped
    assert len(runner.attn_backend.dense.req_at) == 2
    # Request 2's req_to_token row is reused by a new request: its EXTEND must drop the stale row.
    old_row = seqs[2].row
    runner.req_to_token_pool.free(old_row)
    fresh = Seq(runner, torch.randint(0, 4000, (6,), generator=g).tolist())
    assert fresh.row == old_row
    runner.forward(make_batch([fresh], ForwardMode.EXTEND, [6]))
    assert old_row not in runner.attn_backend.dense.row_of
    twin = Seq(runner, fresh.ids)
    runner.forward(make_batch([twin], ForwardMode.EXTEND, [6]))
    seqs.append(fresh)
    twins.append(twin)
    step([4, 0])


def test_over_budget_falls_back_to_gathering(runner: ModelRunner) -> None:
    cache = runner.attn_backend.dense
    saved = cache.max_bytes
    cache.reset()
    cache.max_bytes = 1024  # nothing fits
    try:
        s = Seq(runner, [5, 6, 7])
        runner.forward(make_batch([s], ForwardMode.EXTEND, [3]))
        decode(runner, [s], dense=True)
        assert runner.attn_backend.metadata.dense_rows is None and not cache.row_of
    finally:
        cache.max_bytes = saved


def test_grows_to_just_what_fits_when_doubling_would_not(runner: ModelRunner) -> None:
    cache = runner.attn_backend.dense
    saved = cache.max_bytes
    cache.reset()
    cache.k, cache.v = [], []
    pool = runner.token_to_kv_pool
    heads, dim = pool.k_buffer[0].shape[1], pool.k_buffer[0].shape[2]
    row_bytes = 2 * len(pool.k_buffer) * heads * dim * pool.k_buffer[0].element_size()
    try:
        s = Seq(runner, list(range(10, 149)))  # 139 prompt tokens: the decode step holds 140
        runner.forward(make_batch([s], ForwardMode.EXTEND, [139]))
        cache.max_bytes = 8 * 256 * row_bytes - 1  # doubling (8 rows x 256 positions) does not fit
        decode(runner, [s], dense=True)
        assert runner.attn_backend.metadata.dense_rows is not None
        assert cache.v[0].shape == (8, heads, 192, dim)  # 140 rounded up to the C kernels' K^T blocks
    finally:
        cache.max_bytes = saved
        cache.reset()


def sharing(runner: ModelRunner, leader: Seq, n: int, own: list[int]) -> Seq:
    """A request whose first n tokens are the leader's, on the leader's KV slots (a radix-cache hit)."""
    s = Seq(runner, leader.ids[:n] + own)
    table = runner.req_to_token_pool.req_to_token
    table[s.row, :n] = table[leader.row, :n]
    s.cached = n
    runner.forward(make_batch([s], ForwardMode.EXTEND, [len(own)]))
    return s


def twin_of(runner: ModelRunner, s: Seq) -> Seq:
    """The same sequence on its own slots: the reference read through the gather path."""
    t = Seq(runner, s.ids)
    runner.forward(make_batch([t], ForwardMode.EXTEND, [len(t.ids)]))
    return t


def check_step(runner: ModelRunner, seqs: list[Seq], twins: list[Seq], active: list[int]) -> None:
    """One decode step of `active` on the dense rows against their twins on the gather path: the same
    logits, within bf16 rounding where prefixes go on AMX tiles (test_cpu_kernels.py bounds the kernel)."""
    dense = decode(runner, [seqs[i] for i in active], dense=True)
    gathered = decode(runner, [twins[i] for i in active], dense=False)
    shared = runner.attn_backend.dense.shared
    if shared is not None and shared.tiles:
        assert float((dense - gathered).norm() / gathered.norm()) < 1e-2  # a misread prefix: ~1
    else:
        torch.testing.assert_close(dense, gathered, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                                  ("float32", "fp8_e4m3"), ("float32", "fp8_e5m2"),
                                                  ("bfloat16", "bfloat16"), ("bfloat16", "fp8_e4m3")])
def test_rows_sharing_a_prompt_prefix_read_one_copy_of_it(model_dir: str, dtype: str, kv_cache_dtype: str) -> None:
    """bfloat16, fp8: the rows and the pool hold it, the prefix copies its prefix_dtype (bf16 for fp8: the
    same values), the gather path widens what it reads. Under bf16 linears on a CPU with AMX the prefix
    goes on tiles (bf16 products); under float32 linears never."""
    runner = ModelRunner(model_dir, device="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_total_tokens=4096,
                         max_running_requests=16)  # its own rows
    cache = runner.attn_backend.dense
    assert cache.shared is not None  # on with the C kernel
    assert kv_cache_dtype_name(runner.token_to_kv_pool.dtype) == kv_cache_dtype
    cache.reset()
    g = torch.Generator().manual_seed(2)
    leader = Seq(runner, torch.randint(0, 4000, (100,), generator=g).tolist())
    loner = Seq(runner, torch.randint(0, 4000, (90,), generator=g).tolist())
    runner.forward(make_batch([leader, loner], ForwardMode.EXTEND, [100, 90]))
    seqs = [leader, loner] + [sharing(runner, leader, 80, torch.randint(0, 4000, (k,), generator=g).tolist())
                              for k in (10, 25)]
    twins = [twin_of(runner, s) for s in seqs]

    def step(active: list[int]) -> None:
        check_step(runner, seqs, twins, active)

    step([0, 1, 2, 3])
    assert cache.prefix_buffers(0)[0].dtype == prefix_dtype(runner.token_to_kv_pool.dtype)
    native = runner.attn_backend.native
    assert cache.shared.tiles == (dtype == "bfloat16" and native.tiles_for(
        runner.token_to_kv_pool.dtype, runner.token_to_kv_pool.k_buffer[0].shape[2]))
    # The leader and both followers read the 80 shared positions from one entry; the loner has none.
    plen = {s.row: cache.plen_at[cache.row_of[s.row]] for s in seqs}
    assert plen == {leader.row: 80, loner.row: 0, seqs[2].row: 80, seqs[3].row: 80}
    assert len(cache.shared) == 1
    step([0, 1, 2, 3])
    step([3, 1, 0])      # a follower leaves, the rows reorder
    step([1, 3])
    assert len(cache.shared) == 1
    step([1])            # the last request on the prefix leaves: the entry goes with it
    assert len(cache.shared) == 0
    step([2, 1, 3])      # rejoining followers share it again, from a new entry
    assert len(cache.shared) == 1 and cache.plen_at[cache.row_of[seqs[2].row]] == 80


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_that_decoded_alone_moves_onto_the_prefix_others_then_share(model_dir: str, dtype: str) -> None:
    """A burst's first request decodes alone before the others of its prompt join; once they create the
    shared entry, its row reads the prefix from it too, its own positions moved to the row's front."""
    runner = ModelRunner(model_dir, device="cpu", dtype=dtype, max_total_tokens=4096, max_running_requests=16)
    cache = runner.attn_backend.dense
    cache.reset()
    g = torch.Generator().manual_seed(3)
    leader = Seq(runner, torch.randint(0, 4000, (100,), generator=g).tolist())
    runner.forward(make_batch([leader], ForwardMode.EXTEND, [100]))
    seqs, twins = [leader], [twin_of(runner, leader)]
    check_step(runner, seqs, twins, [0])
    check_step(runner, seqs, twins, [0])
    assert cache.plen_at[cache.row_of[leader.row]] == 0 and len(cache.shared) == 0
    for k in (10, 25):
        seqs.append(sharing(runner, leader, 80, torch.randint(0, 4000, (k,), generator=g).tolist()))
        twins.append(twin_of(runner, seqs[-1]))
    check_step(runner, seqs, twins, [0, 1, 2])
    assert {cache.plen_at[cache.row_of[s.row]] for s in seqs} == {80} and len(cache.shared) == 1
    assert cache.len_at[cache.row_of[leader.row]] == len(leader.ids) - 80
    check_step(runner, seqs, twins, [0, 1, 2])
    check_step(runner, seqs, twins, [1, 2])  # the leader leaves, the entry stays with the others
    assert len(cache.shared) == 1
    check_step(runner, seqs, twins, [2])


def test_growing_for_rows_sizes_positions_for_this_batch(model_dir: str) -> None:
    """A long request that has left does not set the positions of the rows grown after it."""
    runner = ModelRunner(model_dir, device="cpu", max_total_tokens=4096, max_running_requests=24)  # its own rows
    cache = runner.attn_backend.dense
    cache.reset()
    g = torch.Generator().manual_seed(4)
    long = Seq(runner, torch.randint(0, 4000, (300,), generator=g).tolist())
    runner.forward(make_batch([long], ForwardMode.EXTEND, [300]))
    decode(runner, [long], dense=True)
    assert cache.v[0].shape[0] == 8 and cache.v[0].shape[2] == 512
    short = [Seq(runner, torch.randint(0, 4000, (20,), generator=g).tolist()) for _ in range(9)]
    runner.forward(make_batch(short, ForwardMode.EXTEND, [20] * 9))
    twins = [Seq(runner, s.ids) for s in short]
    runner.forward(make_batch(twins, ForwardMode.EXTEND, [20] * 9))
    dense = decode(runner, short, dense=True)
    torch.testing.assert_close(dense, decode(runner, twins, dense=False), atol=1e-5, rtol=1e-5)
    assert cache.v[0].shape[0] == 16 and cache.v[0].shape[2] == 64
