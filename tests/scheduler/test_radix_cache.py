"""RadixCache: matching, splitting, locking, LRU eviction, and the accounting invariants (check())."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.kvcache.memory_pool import TokenToKVPool
from services.scheduler.kvcache.radix_cache import RadixCache


def make(size: int = 256) -> tuple[TokenToKVPool, RadixCache]:
    pool = TokenToKVPool(size, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                         device=torch.device("cpu"))
    return pool, RadixCache(pool)


def put(pool: TokenToKVPool, tree: RadixCache, ids: list[int]) -> torch.Tensor:
    """Insert ids with freshly allocated slots, freeing duplicates like the scheduler does."""
    slots = pool.alloc(len(ids))
    already = tree.insert(ids, slots)
    pool.free(slots[:already])
    return slots


def test_match_insert_and_split() -> None:
    pool, tree = make()
    a = put(pool, tree, [1, 2, 3, 4, 5])
    tree.check()
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.indices.tolist() == a[:3].tolist()
    tree.check()  # the match split [1..5] into [1,2,3] + [4,5]
    assert tree.insert([1, 2, 3, 4, 5, 6], torch.tensor([90, 91, 92, 93, 94, 95])) == 5
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert m.indices.tolist() == a.tolist() + [95]
    assert tree.match_prefix([7, 8]).indices.numel() == 0
    assert tree.evictable_size() == 6 and tree.protected_size() == 0
    tree.check()


def test_locked_nodes_are_never_evicted() -> None:
    pool, tree = make()
    put(pool, tree, [1, 2, 3, 4])
    put(pool, tree, [1, 2, 7, 8])
    m = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(m.last_node)
    assert tree.protected_size() == 4 and tree.evictable_size() == 2
    free_before = pool.available_size()
    assert tree.evict(100) == 2  # only the unlocked branch [7, 8]
    assert pool.available_size() == free_before + 2
    assert tree.match_prefix([1, 2, 3, 4]).indices.numel() == 4
    tree.check()
    tree.dec_lock_ref(m.last_node)
    assert tree.protected_size() == 0 and tree.evictable_size() == 4
    assert tree.evict(4) == 4
    assert tree.total_size() == 0 and pool.available_size() == pool.size
    tree.check()


def test_evict_zero_and_lru_order() -> None:
    pool, tree = make()
    assert tree.evict(0) == 0 and tree.evict(10) == 0
    put(pool, tree, [1, 1])
    put(pool, tree, [2, 2])
    put(pool, tree, [3, 3])
    tree.match_prefix([1, 1])  # touch: [1, 1] is now the most recent
    assert tree.evict(0) == 0
    assert tree.evict(1) == 2  # whole leaf [2, 2], the least recently used
    assert tree.match_prefix([2, 2]).indices.numel() == 0
    assert tree.match_prefix([1, 1]).indices.numel() == 2
    tree.check()


def test_check_detects_corruption() -> None:
    pool, tree = make()
    put(pool, tree, [1, 2, 3])
    tree._evictable += 1
    try:
        tree.check()
    except AssertionError:
        pass
    else:
        raise AssertionError("check() missed a wrong evictable count")


def test_disabled_cache_matches_nothing() -> None:
    pool = TokenToKVPool(16, 1, 1, 2, torch.float32, torch.device("cpu"))
    tree = RadixCache(pool, disable=True)
    assert tree.insert([1, 2], torch.tensor([1, 2])) == 0
    assert tree.match_prefix([1, 2]).indices.numel() == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=25),
       st.integers(0, 2**16))
def test_random_ops_keep_invariants(seqs: list[list[int]], seed: int) -> None:
    """Pool slots are conserved: free + held by the tree == size, whatever the operations."""
    rng = random.Random(seed)
    pool, tree = make(512)
    locked = []
    for ids in seqs:
        op = rng.random()
        if op < 0.5:
            put(pool, tree, ids)
        elif op < 0.7:
            m = tree.match_prefix(ids)
            tree.inc_lock_ref(m.last_node)
            locked.append(m.last_node)
        elif op < 0.85 and locked:
            tree.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            tree.evict(rng.randrange(0, 8))
        tree.check()
        assert pool.available_size() + tree.total_size() == pool.size
    for node in locked:
        tree.dec_lock_ref(node)
    tree.evict(10**6)
    tree.check()
    assert tree.total_size() == 0 and pool.available_size() == pool.size
