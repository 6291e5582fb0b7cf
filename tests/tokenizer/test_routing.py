"""Routing policies and the prefix tree behind cache_aware."""

from __future__ import annotations

import pytest

from ringserve.errors import Unavailable
from ringserve.message import Load
from services.tokenizer.prefix_tree import PrefixTree
from services.tokenizer.routing import CacheAware, LeastLoad, RoundRobin, SchedulerView, make_router


def view(addr: str, running: int = 0, queued: int = 0, usage: float = 0.0, connected: bool = True,
         in_flight: int = 0) -> SchedulerView:
    return SchedulerView(addr, connected, Load(num_running_reqs=running, num_queue_reqs=queued,
                                               token_usage=usage), in_flight)


def test_round_robin_cycles_over_live_schedulers():
    rr = RoundRobin()
    views = [view("a"), view("b", connected=False), view("c")]
    assert [rr.select([1], views) for _ in range(4)] == ["a", "c", "a", "c"]


def test_no_live_scheduler_is_unavailable_naming_it():
    with pytest.raises(Unavailable, match="scheduler a:1 unavailable"):
        RoundRobin().select([1], [view("a:1", connected=False)])
    with pytest.raises(Unavailable, match="no scheduler available"):
        LeastLoad().select([1], [view("a", connected=False), view("b", connected=False)])


def test_least_load_uses_requests_then_token_usage_and_own_in_flight():
    ll = LeastLoad()
    assert ll.select([1], [view("a", running=3), view("b", running=1, queued=1)]) == "b"
    assert ll.select([1], [view("a", running=1, usage=0.9), view("b", running=1, usage=0.1)]) == "b"
    # Fresher than the last report: this tokenizer already sent 5 there.
    assert ll.select([1], [view("a", in_flight=5), view("b", running=2)]) == "b"


def test_cache_aware_follows_prefix_when_balanced():
    ca = CacheAware(cache_threshold=0.5)
    views = [view("a"), view("b")]
    prompt = list(range(100))
    first = ca.select(prompt, views)
    other = "b" if first == "a" else "a"
    # The other one is now slightly less loaded, but the prefix wins while balanced.
    views = [view(first, running=2), view(other, running=1)]
    assert ca.select(prompt[:90] + [999] * 10, views) == first
    # A prompt sharing too little goes to the least loaded.
    assert ca.select(prompt[:10] + list(range(500, 590)), views) == other


def test_cache_aware_goes_to_least_load_when_imbalanced():
    ca = CacheAware(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = list(range(50))
    ca.tree.insert(prompt, "a")
    assert ca.select(prompt, [view("a", running=3), view("b", running=1)]) == "a"  # balanced: prefix
    assert ca.select(prompt, [view("a", running=20), view("b", running=2)]) == "b"  # imbalanced: load


def test_cache_aware_forgets_a_scheduler_and_skips_dead_ones():
    ca = CacheAware()
    prompt = list(range(20))
    ca.tree.insert(prompt, "a")
    assert ca.select(prompt, [view("a", connected=False), view("b")]) == "b"
    ca.forget("a")
    assert ca.tree.match(prompt, {"a"}).length == 0
    ca.tree.check()


def test_make_router_names():
    assert [make_router(p).name for p in ("round_robin", "least_load", "cache_aware")] == [
        "round_robin", "least_load", "cache_aware"]
    with pytest.raises(ValueError):
        make_router("random")


def test_prefix_tree_match_and_tenants():
    t = PrefixTree()
    t.insert([1, 2, 3, 4], "a")
    t.insert([1, 2, 9], "b")
    assert t.match([1, 2, 3, 4, 5]) == (4, "a")
    assert t.match([1, 2, 9, 9]) == (3, "b")
    assert t.match([1, 2]).length == 2
    assert t.match([1, 2, 3], {"b"}) == (2, "b")
    assert t.match([7]) == (0, None)
    assert t.tenant_size == {"a": 4, "b": 3}
    t.check()


def test_prefix_tree_is_bounded_and_evicts_least_recent():
    t = PrefixTree(max_tokens=100)
    t.insert(list(range(60)), "a")  # old
    t.insert(list(range(1000, 1060)), "b")  # newer: pushes the size to 120 > 100
    assert t.size <= 100
    t.check()
    assert t.match(list(range(1000, 1060))).length == 60  # the newest prompt is intact
    assert t.match(list(range(60))).length < 60  # the oldest lost its tail
    for i in range(50):
        t.insert([i] * 30 + [i + 1], f"s{i % 3}")
        assert t.size <= 100
    t.check()


def test_prefix_tree_remove_tenant_keeps_others():
    t = PrefixTree()
    t.insert([1, 2, 3], "a")
    t.insert([1, 2, 3], "b")
    t.remove_tenant("a")
    assert t.match([1, 2, 3]) == (3, "b") and "a" not in t.tenant_size
    t.check()
