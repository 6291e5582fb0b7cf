"""KV pools: slot accounting, the reserved dummy slot, writes."""

from __future__ import annotations

import torch

from services.scheduler.kvcache.memory_pool import ReqToTokenPool, TokenToKVPool


def test_req_to_token_pool_rows() -> None:
    pool = ReqToTokenPool(3, 16, torch.device("cpu"))
    assert pool.req_to_token.shape == (3, 16) and pool.req_to_token.dtype == torch.int64
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and pool.alloc() is None and pool.available_size() == 0
    pool.free(rows[1])
    assert pool.available_size() == 1 and pool.alloc() == rows[1]


def test_token_pool_alloc_free_accounting() -> None:
    pool = TokenToKVPool(10, 2, 2, 4, torch.float32, torch.device("cpu"))
    assert pool.k_buffer[0].shape == (11, 2, 4) and len(pool.v_buffer) == 2
    a = pool.alloc(4)
    b = pool.alloc(6)
    assert a.dtype == torch.int64 and a.shape == (4,)
    got = set(a.tolist()) | set(b.tolist())
    assert got == set(range(1, 11))  # slot 0 is never handed out
    assert pool.available_size() == 0 and pool.alloc(1) is None
    pool.free(a[:2])
    pool.free(b[3:])
    assert pool.available_size() == 5
    assert pool.alloc(6) is None and pool.available_size() == 5  # a failed alloc takes nothing
    c = pool.alloc(5)
    assert set(c.tolist()) == set(a[:2].tolist()) | set(b[3:].tolist())
    pool.free(torch.empty(0, dtype=torch.int64))
    pool.clear()
    assert pool.available_size() == 10


def test_many_small_allocs_and_frees() -> None:
    pool = TokenToKVPool(64, 1, 1, 2, torch.float32, torch.device("cpu"))
    held: list[torch.Tensor] = []
    g = torch.Generator().manual_seed(0)
    for _step in range(500):
        if held and (pool.available_size() < 4 or torch.rand(1, generator=g) < 0.4):
            pool.free(held.pop(int(torch.randint(len(held), (1,), generator=g))))
        else:
            held.append(pool.alloc(int(torch.randint(1, 4, (1,), generator=g))))
        live = torch.cat(held).tolist() if held else []
        assert len(live) == len(set(live)) and 0 not in live
        assert pool.available_size() + len(live) == 64


def test_set_kv_buffer_writes_slots() -> None:
    pool = TokenToKVPool(8, 2, 2, 3, torch.float32, torch.device("cpu"))
    loc = pool.alloc(2)
    k, v = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
    pool.set_kv_buffer(1, loc, k, v)
    kb, vb = pool.get_kv_buffer(1)
    assert torch.equal(kb[loc], k) and torch.equal(vb[loc], v)
    assert torch.count_nonzero(pool.k_buffer[0]) == 0


def test_fp8_slots_hold_saturated_nearest_values() -> None:
    """fp8 KV (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): stores round to nearest even and saturate at the
    largest finite value (torch's cast would give NaN or infinity past it), a NaN stays a NaN."""
    for dtype, top in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        pool = TokenToKVPool(8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=dtype, device=torch.device("cpu"))
        assert pool.bytes_per_token == 2 * 4  # a byte a value
        k = torch.tensor([[[0.3, -1e6, 1e6, float("nan")]]])
        v = torch.tensor([[[1.0625, 2e-3, -7.0, 0.0]]])
        pool.set_kv_buffer(0, torch.tensor([3]), k, v)
        kb, vb = pool.get_kv_buffer(0)
        got_k = kb[3].float()
        assert got_k[0, 0] == torch.tensor(0.3).to(dtype).float() and got_k[0, 1] == -top and got_k[0, 2] == top
        assert got_k[0, 3].isnan()
        assert torch.equal(vb[3].float(), v[0].to(dtype).float())
        assert kb[2].float().abs().sum() == 0  # other slots untouched
