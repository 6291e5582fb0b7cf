"""Prefill admission (budgets, chunking, running limit, KV reservation) and queue order (fcfs, lpm)."""

from __future__ import annotations

from collections import deque

import torch

from services.scheduler.core.prefill import PrefillAdder, order_waiting
from services.scheduler.core.req import Req
from services.scheduler.kvcache.kv_manager import KVManager
from services.scheduler.kvcache.memory_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.kvcache.radix_cache import RadixCache
from services.scheduler.model_executor.sampling import SamplingParams


def make_kv(size: int = 1000, rows: int = 8) -> KVManager:
    cpu = torch.device("cpu")
    pool = TokenToKVPool(size, 1, 1, 2, torch.float32, cpu)
    return KVManager(ReqToTokenPool(rows, 512, cpu), pool, RadixCache(pool))


def req(rid: str, ids: list[int], max_new: int = 10) -> Req:
    return Req(rid=rid, origin_input_ids=ids, params=SamplingParams(max_new_tokens=max_new))


def cache(kv: KVManager, ids: list[int]) -> None:
    slots = kv.kv_pool.alloc(len(ids))
    kv.tree.insert(ids, slots)


def adder(kv: KVManager, running=(), max_prefill=10_000, chunk=0, max_running=8, ratio=1.0) -> PrefillAdder:
    return PrefillAdder(kv, list(running), max_prefill, chunk, max_running, ratio)


def test_fcfs_keeps_arrival_order_and_lpm_puts_longest_match_first() -> None:
    kv = make_kv()
    cache(kv, list(range(1, 41)))
    a, b, c = req("a", [90, 91, 92]), req("b", list(range(1, 21)) + [99]), req("c", list(range(1, 41)) + [98])
    q = deque([a, b, c])
    order_waiting(q, "fcfs", kv)
    assert [r.rid for r in q] == ["a", "b", "c"]
    order_waiting(q, "lpm", kv)
    assert [r.rid for r in q] == ["c", "b", "a"]


def test_prefix_match_leaves_one_token_to_compute() -> None:
    kv = make_kv()
    ids = list(range(1, 11))
    cache(kv, ids)
    r = req("r", ids)
    ad = adder(kv)
    assert ad.add(r) == "added"
    assert r.kv_len == 9 and ad.extend_lens == [1]
    assert kv.tree.protected_size() == 9  # the prefix is locked while r runs
    kv.tree.check()


def test_prefill_token_budget_stops_admission() -> None:
    kv = make_kv()
    ad = adder(kv, max_prefill=25)
    assert ad.add(req("a", list(range(100, 120)))) == "added"
    assert ad.add(req("b", list(range(200, 220)))) == "stop"  # 20 more would pass 25
    assert [r.rid for r in ad.reqs] == ["a"]
    assert kv.req_pool.available_size() == 7  # b took no row


def test_first_request_may_exceed_prefill_budget_without_chunking() -> None:
    kv = make_kv()
    ad = adder(kv, max_prefill=8)
    assert ad.add(req("a", list(range(100, 130)))) == "stop"
    assert ad.extend_lens == [30]


def test_chunked_prefill_cuts_the_crossing_request() -> None:
    kv = make_kv()
    ad = adder(kv, chunk=16)
    assert ad.add(req("a", list(range(100, 110)))) == "added"
    long = req("b", list(range(200, 250)))
    assert ad.add(long) == "chunked"
    assert ad.extend_lens == [10, 6] and ad.chunked is long
    long.kv_len += 6  # what the scheduler does after the forward
    nxt = adder(kv, chunk=16)
    assert nxt.add(long) == "chunked" and nxt.extend_lens == [16]


def test_running_limit_and_kv_reservation() -> None:
    kv = make_kv(size=100)
    running = [req(f"r{i}", [1, 2], max_new=30) for i in range(2)]  # reserve 2 x 30 tokens
    ad = adder(kv, running=running, max_running=3)
    assert ad.add(req("a", list(range(10, 30)), max_new=10)) == "added"  # 20 + 10 <= 100 - 60
    assert ad.add(req("b", list(range(40, 45)), max_new=1)) == "stop"   # running limit (2 + 1)
    ad2 = adder(make_kv(size=100), running=running, max_running=8)
    assert ad2.add(req("c", list(range(10, 40)), max_new=20)) == "stop"  # 30 + 20 > 40 left


def test_nothing_running_admits_a_prompt_that_only_fits_without_reservation() -> None:
    kv = make_kv(size=50)
    ad = adder(kv)
    assert ad.add(req("a", list(range(10, 50)), max_new=1000)) in ("added", "stop")
    assert ad.extend_lens == [40]
