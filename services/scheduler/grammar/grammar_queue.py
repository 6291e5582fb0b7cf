"""The scheduler's grammar queue: requests whose constraint is compiling wait here, not in `waiting`.

`submit` looks the constraint up in the cache (a hit is ready at the next `poll`, same step) or
starts a compile on a small thread pool; requests with the same constraint share one compile.
`poll` never blocks: it returns the requests whose grammar is ready (each with its own matcher)
or failed (invalid constraint, or not compiled within `timeout_s`). A failure aborts only that
request. The scheduler thread alone calls submit / poll / cancel; workers only run compiles.

A timed-out compile cannot be interrupted (xgrammar has no cancel); it finishes on its worker and
its result still goes into the cache, so a retry of the same constraint then hits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import grpc

from services.scheduler.grammar.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarKind,
    GrammarMatcher,
    field_of,
)
from services.scheduler.grammar.grammar_cache import CacheEntry, GrammarCache, GrammarKey
from services.scheduler.grammar.metrics import GrammarMetrics


class GrammarQueueFull(Exception):
    """More than max_size requests are waiting for grammars (the scheduler answers RESOURCE_EXHAUSTED)."""


class GrammarReady(NamedTuple):
    rid: str
    matcher: GrammarMatcher | None  # None when error is set
    error: str | None = None        # "sampling_params.<kind>: why", ready for the abort's message
    status: grpc.StatusCode = grpc.StatusCode.OK  # how the request's call ends when error is set


class _Compiled(NamedTuple):
    entry: CacheEntry
    seconds: float


@dataclass
class _Pending:
    key: GrammarKey
    future: Future[_Compiled] | None  # None: resolved from the cache at submit
    deadline: float
    entry: CacheEntry | None = None


class GrammarQueue:
    def __init__(self, backend: GrammarBackend, cache: GrammarCache | None = None, *, timeout_s: float = 30.0,
                 max_size: int = 1024, workers: int = 2, on_ready: Callable[[], None] | None = None,
                 metrics: GrammarMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """on_ready: called from a worker thread when a compile finishes (e.g. Engine.wake, so an
        idle loop polls at once instead of at its next timeout)."""
        self.backend = backend
        self.cache = cache or GrammarCache()
        self.timeout_s = timeout_s
        self.max_size = max_size
        self.on_ready = on_ready
        self.metrics = metrics
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._pending: dict[str, _Pending] = {}       # rid -> its wait, in submit order
        self._inflight: dict[GrammarKey, Future[_Compiled]] = {}

    # -- scheduler thread ------------------------------------------------------------------------

    def submit(self, rid: str, kind: GrammarKind, text: str) -> None:
        if len(self._pending) >= self.max_size:
            raise GrammarQueueFull(f"{len(self._pending)} requests are waiting for grammars (max {self.max_size})")
        key: GrammarKey = (kind, text)
        deadline = self.clock() + self.timeout_s
        entry = self.cache.get(key)
        if entry is not None:
            if self.metrics is not None:
                self.metrics.cache_hits.inc()
            self._pending[rid] = _Pending(key, None, deadline, entry)
        else:
            future = self._inflight.get(key)
            if future is None:
                future = self._pool.submit(self._compile, kind, text)
                self._inflight[key] = future
                if self.on_ready is not None:
                    future.add_done_callback(lambda _f: self.on_ready())  # type: ignore[misc]
            self._pending[rid] = _Pending(key, future, deadline)
        self._gauge()

    def poll(self) -> list[GrammarReady]:
        """Requests whose grammar is ready or failed, in submit order; the rest keep waiting."""
        self._store_finished()
        if not self._pending:
            return []
        now = self.clock()
        out: list[GrammarReady] = []
        for rid, p in list(self._pending.items()):
            if p.entry is None and p.future is not None and p.future.done():
                p.entry = self._outcome(p.key, p.future)
            if p.entry is not None:
                out.append(self._resolve(rid, p.entry))
            elif now >= p.deadline:
                out.append(GrammarReady(rid, None, f"{field_of(p.key[0])}: grammar compilation took longer "
                                                   f"than {self.timeout_s:g}s", grpc.StatusCode.DEADLINE_EXCEEDED))
                self._count("timeout")
            else:
                continue
            del self._pending[rid]
        self._gauge()
        return out

    def cancel(self, rid: str) -> bool:
        """Forget rid (abort while compiling). The compile goes on if others wait for it."""
        p = self._pending.pop(rid, None)
        if p is None:
            return False
        if p.future is not None and not any(q.key == p.key for q in self._pending.values()):
            if p.future.cancel():  # not started yet: nobody else needs it
                self._inflight.pop(p.key, None)
        self._gauge()
        return True

    def has_ready(self) -> bool:
        """A poll now would return something (the loop's has_work: step only when it would)."""
        now = self.clock()
        return any(p.entry is not None or (p.future is not None and p.future.done()) or now >= p.deadline
                   for p in self._pending.values())

    def next_deadline_s(self) -> float | None:
        """Seconds until the earliest timeout (an idle loop sleeps at most this long), None if empty."""
        if not self._pending:
            return None
        return max(0.0, min(p.deadline for p in self._pending.values()) - self.clock())

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, rid: str) -> bool:
        return rid in self._pending

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- internals -------------------------------------------------------------------------------

    def _compile(self, kind: GrammarKind, text: str) -> _Compiled:
        """Worker thread: never raises, so the outcome travels as a value."""
        t0 = time.perf_counter()
        try:
            entry: CacheEntry = self.backend.compile(kind, text)
        except GrammarError as e:
            entry = e
        except Exception as e:  # a backend bug must not take the loop down: abort just this request
            entry = GrammarError(field_of(kind), f"internal error while compiling: {type(e).__name__}: {e}",
                                 internal=True)
        return _Compiled(entry, time.perf_counter() - t0)

    def _store_finished(self) -> None:
        """Move finished compiles into the cache (also those whose requests timed out or left)."""
        for key, future in list(self._inflight.items()):
            if future.done():
                del self._inflight[key]
                if not future.cancelled():
                    self._outcome(key, future)

    def _outcome(self, key: GrammarKey, future: Future[_Compiled]) -> CacheEntry:
        if future.cancelled():  # cannot happen for a pending request, but be total
            return GrammarError(field_of(key[0]), "grammar compilation was cancelled")
        done = future.result()
        if key not in self.cache and not (isinstance(done.entry, GrammarError) and done.entry.internal):
            self.cache.put(key, done.entry)
            if self.metrics is not None:
                self.metrics.observe_compile(key[0], done.seconds)
        return done.entry

    def _resolve(self, rid: str, entry: CacheEntry) -> GrammarReady:
        if isinstance(entry, CompiledGrammar):
            return GrammarReady(rid, entry.matcher())
        self._count("internal" if entry.internal else "invalid")
        return GrammarReady(rid, None, str(entry), grpc.StatusCode.INTERNAL if entry.internal
                            else grpc.StatusCode.INVALID_ARGUMENT)

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_error(reason)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_reqs.set(len(self._pending))
