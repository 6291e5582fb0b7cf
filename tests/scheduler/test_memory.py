"""The scheduler's memory accounting (services/scheduler/memory.py): the startup check, the holders'
figures and bounds, the grammar cache's byte bound, and what an idle engine gives back."""

from __future__ import annotations

import pytest

from ringserve.message import SamplingParams
from services.scheduler import memory
from services.scheduler.config import EngineConfig
from services.scheduler.core.engine import Engine
from services.scheduler.grammar import CompiledGrammar, GrammarCache, GrammarError
from services.scheduler.grammar.backend import GrammarMatcher

MIB = memory.MIB


def test_check_fits_passes_within_the_room_and_names_the_largest_setting_beyond_it() -> None:
    kv = memory.Bound(100 * MIB, "KV pool", "--max-total-tokens")
    memory.check_fits([kv], (1024 * MIB, "MemAvailable"))
    memory.check_fits([kv._replace(bytes=1 << 50)], (None, ""))  # room unknown: nothing to check
    with pytest.raises(memory.MemoryBudgetError) as e:
        memory.check_fits([kv, memory.Bound(900 * MIB, "decode caches", "--decode-cache-mib")],
                          (800 * MIB, "the cgroup memory limit"))
    text = str(e.value)
    assert "lower --decode-cache-mib" in text and "the cgroup memory limit leaves 800 MiB" in text
    assert "1256 MiB" in text  # 100 + 900 + the runtime headroom


def test_room_and_rss_are_read_from_the_machine() -> None:
    room, source = memory.room_bytes()
    assert room is not None and room > 0 and source
    assert memory.rss_bytes() > 10 * MIB


class _Compiled(CompiledGrammar):
    def __init__(self, size: int) -> None:
        self.size = size

    def matcher(self) -> GrammarMatcher:
        raise NotImplementedError

    def memory_bytes(self) -> int:
        return self.size


def test_configure_malloc_sets_arenas_and_thresholds_unless_the_environment_does(monkeypatch) -> None:
    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def mallopt(self, param, value) -> int:
            calls.append((param.value, value.value))
            return 1

    monkeypatch.setattr(memory, "_LIBC", FakeLibc())
    for env in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(env, raising=False)
    memory.configure_malloc(3)
    assert calls == [(memory.M_ARENA_MAX, 3), (memory.M_MMAP_THRESHOLD, memory.MMAP_THRESHOLD),
                     (memory.M_TRIM_THRESHOLD, memory.TRIM_THRESHOLD)]
    calls.clear()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")  # the operator's choice stands
    memory.configure_malloc()
    assert calls == [(memory.M_ARENA_MAX, memory.MALLOC_ARENAS), (memory.M_TRIM_THRESHOLD, memory.TRIM_THRESHOLD)]
    # glibc's highest mmap threshold on 64-bit: a larger value would be refused and nothing set
    assert memory.MMAP_THRESHOLD <= 32 * MIB


def test_grammar_cache_keeps_its_byte_bound_least_recently_used_out_first() -> None:
    cache = GrammarCache(max_entries=10, max_bytes=100)
    for i in range(3):
        cache.put(("regex", str(i)), _Compiled(40))
    assert len(cache) == 2 and cache.bytes == 80 and ("regex", "0") not in cache
    cache.put(("regex", "bad"), GrammarError("regex", "invalid"))  # errors cost nothing
    assert len(cache) == 3 and cache.bytes == 80
    cache.put(("regex", "huge"), _Compiled(500))  # alone over the bound: kept, everything else out
    assert len(cache) == 1 and cache.bytes == 500
    cache.clear()
    assert cache.bytes == 0


def test_engine_accounts_its_holders_and_returns_the_decode_caches_when_idle(model_dir: str) -> None:
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=4096, max_running_requests=16,
                                 decode_cache_mib=64))
    items = {i.name: i for i in engine.memory_items()}
    assert {"weights", "kv_pool", "req_to_token", "decode_rows", "shared_prefixes", "radix_cache",
            "grammar"} == set(items)
    pool = engine.runner.token_to_kv_pool
    assert items["kv_pool"].used_bytes == items["kv_pool"].bound_bytes == pool.bytes_per_token * (pool.size + 1)
    assert items["decode_rows"].bound_bytes == 64 * MIB and items["decode_rows"].used_bytes == 0
    assert items["weights"].used_bytes > 0 and items["grammar"].bound_bytes >= 64 * MIB

    engine.generate([[5, 6, 7, 8]] * 8, SamplingParams(max_new_tokens=16, ignore_eos=True))
    items = {i.name: i for i in engine.memory_items()}
    assert 0 < items["decode_rows"].used_bytes <= items["decode_rows"].bound_bytes
    assert items["radix_cache"].used_bytes > 0
    load = engine.load()
    assert load.memory_accounted_bytes == sum(i.used_bytes for i in engine.memory_items())
    assert load.memory_bound_bytes >= load.memory_accounted_bytes
    assert load.rss_bytes > items["kv_pool"].used_bytes

    assert engine.release_idle()
    assert {i.name: i for i in engine.memory_items()}["decode_rows"].used_bytes == 0
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # regrows
    assert len(out[0].output_ids) == 4


def test_bounds_larger_than_the_machine_fail_before_allocating_naming_the_setting(model_dir: str) -> None:
    with pytest.raises(memory.MemoryBudgetError, match="lower --decode-cache-mib$"):
        Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=4096, decode_cache_mib=1 << 30))
    # The decode caches' default is twice the pool: a huge pool names the pool's setting.
    with pytest.raises(memory.MemoryBudgetError, match="lower --max-total-tokens or set --decode-cache-mib$"):
        Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=1 << 30))
