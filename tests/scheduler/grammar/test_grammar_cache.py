"""GrammarCache: bounded LRU by (kind, text), errors cached, hit/miss counts."""

from __future__ import annotations

import pytest

from services.scheduler.grammar import GrammarCache, GrammarError
from services.scheduler.grammar.backend import CompiledGrammar


class _G(CompiledGrammar):
    def matcher(self):  # pragma: no cover - never matched here
        raise NotImplementedError


def test_lru_eviction_keeps_recently_used() -> None:
    c = GrammarCache(max_entries=2)
    a, b, d = _G(), _G(), _G()
    c.put(("regex", "a"), a)
    c.put(("regex", "b"), b)
    assert c.get(("regex", "a")) is a          # a is now the most recent
    c.put(("regex", "d"), d)                   # evicts b, the least recent
    assert ("regex", "b") not in c and c.get(("regex", "b")) is None
    assert c.get(("regex", "a")) is a and c.get(("regex", "d")) is d
    assert len(c) == 2 and c.stats() == (2, 3, 1)


def test_kind_is_part_of_the_key() -> None:
    c = GrammarCache()
    g = _G()
    c.put(("regex", "x"), g)
    assert c.get(("ebnf", "x")) is None and c.get(("regex", "x")) is g


def test_errors_are_cached() -> None:
    c = GrammarCache()
    err = GrammarError("sampling_params.regex", "bad")
    c.put(("regex", "("), err)
    assert c.get(("regex", "(")) is err


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError):
        GrammarCache(0)
