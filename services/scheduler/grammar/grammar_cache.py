"""Compiled grammars by (kind, text), least recently used out first, within a count and a byte bound.

Invalid constraints are cached too (as their GrammarError), so a client repeating a bad schema
costs one compile, not one per request. Used from the scheduler thread only (the grammar queue
stores results when it polls), so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from services.scheduler.grammar.backend import CompiledGrammar, GrammarError, GrammarKind

GrammarKey = tuple[GrammarKind, str]
CacheEntry = CompiledGrammar | GrammarError


class CacheStats(NamedTuple):
    entries: int
    hits: int
    misses: int


def _size(entry: CacheEntry) -> int:
    return 0 if isinstance(entry, GrammarError) else entry.memory_bytes()


class GrammarCache:
    def __init__(self, max_entries: int = 256, max_bytes: int = 64 << 20) -> None:
        """max_bytes: the compiled grammars' bytes the cache keeps (the newest entry is kept even if
        it alone is larger: its requests use it anyway)."""
        if max_entries < 1:
            raise ValueError("max_entries: must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[GrammarKey, CacheEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: GrammarKey) -> CacheEntry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: GrammarKey, entry: CacheEntry) -> None:
        old = self._entries.get(key)
        if old is not None:
            self.bytes -= _size(old)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self.bytes += _size(entry)
        while len(self._entries) > self.max_entries or (self.bytes > self.max_bytes and len(self._entries) > 1):
            self.bytes -= _size(self._entries.popitem(last=False)[1])

    def __contains__(self, key: GrammarKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> CacheStats:
        return CacheStats(len(self._entries), self.hits, self.misses)
