"""GrammarQueue: cache hits at once, shared compiles, errors and timeouts abort only their request,
cancel, bound, and a real compile through the xgrammar backend."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.scheduler.grammar import GrammarCache, GrammarError, GrammarQueue, GrammarQueueFull, GrammarReady
from services.scheduler.grammar.backend import CompiledGrammar, GrammarBackend, GrammarMatcher


class _Matcher(GrammarMatcher):
    def __init__(self, text: str) -> None:
        self.text = text

    def accept_token(self, token_id: int) -> bool:
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass

    def reset(self) -> None:
        pass


class _Compiled(CompiledGrammar):
    def __init__(self, text: str) -> None:
        self.text = text

    def matcher(self) -> _Matcher:
        return _Matcher(self.text)


class FakeBackend(GrammarBackend):
    """Texts starting with "slow" block until release(); "bad" is invalid; "boom" is a backend bug."""

    vocab_size = 64

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.compiles: list[str] = []

    def compile(self, kind, text):
        self.compiles.append(text)
        if text.startswith("slow"):
            assert self.gate.wait(10)
        if text == "bad":
            raise GrammarError(f"sampling_params.{kind}", "bad pattern")
        if text == "boom":
            raise KeyError("oops")
        return _Compiled(text)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def wait_poll(q: GrammarQueue, n: int, timeout: float = 5.0) -> list[GrammarReady]:
    """Poll until n results came back (the compile runs on a worker thread)."""
    out: list[GrammarReady] = []
    end = time.monotonic() + timeout
    while len(out) < n:
        out += q.poll()
        assert time.monotonic() < end, f"only {out} after {timeout}s"
        time.sleep(0.001)
    return out


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


def test_compile_then_cache_hit_at_once(fake: FakeBackend) -> None:
    q = GrammarQueue(fake, GrammarCache())
    q.submit("r1", "regex", "a+")
    (r1,) = wait_poll(q, 1)
    assert r1.rid == "r1" and r1.error is None and r1.matcher.text == "a+"  # type: ignore[attr-defined]  # a fake
    q.submit("r2", "regex", "a+")
    assert q.has_ready()
    (r2,) = q.poll()  # resolved from the cache: no waiting for a worker
    assert r2.rid == "r2" and r2.matcher is not r1.matcher  # each request its own matcher
    assert fake.compiles == ["a+"] and len(q) == 0
    q.close()


def test_same_constraint_compiles_once_for_many_requests(fake: FakeBackend) -> None:
    """n > 1 arrives as n requests with one schema: one compile, n matchers."""
    q = GrammarQueue(fake)
    for i in range(4):
        q.submit(f"r-{i}", "json_schema", "slow-schema")
    assert len(q) == 4 and q.poll() == []
    fake.gate.set()
    got = wait_poll(q, 4)
    assert [g.rid for g in got] == [f"r-{i}" for i in range(4)]
    assert len({id(g.matcher) for g in got}) == 4 and fake.compiles == ["slow-schema"]
    q.close()


def test_error_aborts_only_that_request(fake: FakeBackend) -> None:
    q = GrammarQueue(fake)
    q.submit("bad", "regex", "bad")
    q.submit("good", "regex", "fine")
    q.submit("bug", "ebnf", "boom")
    got = {g.rid: g for g in wait_poll(q, 3)}
    assert got["good"].matcher is not None and got["good"].error is None
    assert got["bad"].matcher is None and got["bad"].error == "sampling_params.regex: bad pattern"
    assert got["bad"].status == grpc.StatusCode.INVALID_ARGUMENT
    assert got["bug"].status == grpc.StatusCode.INTERNAL
    assert got["bug"].error.startswith("sampling_params.ebnf: internal error")
    # The invalid one is cached (no recompile); the backend bug is not.
    q.submit("bad2", "regex", "bad")
    assert q.poll()[0].error == "sampling_params.regex: bad pattern"
    assert fake.compiles.count("bad") == 1
    q.close()


def test_timeout_aborts_only_that_request_and_result_is_kept(fake: FakeBackend) -> None:
    clock = Clock()
    q = GrammarQueue(fake, timeout_s=5.0, clock=clock)
    q.submit("slow", "json_schema", "slow-1")
    assert not q.has_ready()
    clock.t = 3.0
    q.submit("fast", "regex", "quick")
    fast = wait_poll(q, 1)
    assert [f.rid for f in fast] == ["fast"] and "slow" in q
    assert q.next_deadline_s() == pytest.approx(2.0)
    assert not q.has_ready()
    clock.t = 5.0
    assert q.has_ready()
    (slow,) = q.poll()
    assert slow.rid == "slow" and slow.matcher is None and slow.status == grpc.StatusCode.DEADLINE_EXCEEDED
    assert slow.error == "sampling_params.json_schema: grammar compilation took longer than 5s"
    assert len(q) == 0 and q.next_deadline_s() is None
    # The abandoned compile still finishes into the cache: a retry hits at once.
    fake.gate.set()
    end = time.monotonic() + 5
    while ("json_schema", "slow-1") not in q.cache:
        q.poll()
        assert time.monotonic() < end
        time.sleep(0.001)
    q.submit("retry", "json_schema", "slow-1")
    (retry,) = q.poll()
    assert retry.matcher is not None and fake.compiles.count("slow-1") == 1
    q.close()


def test_cancel_and_bound(fake: FakeBackend) -> None:
    q = GrammarQueue(fake, max_size=2, workers=1)
    q.submit("a", "regex", "slow-a")
    q.submit("b", "regex", "slow-b")   # queued behind a on the single worker
    with pytest.raises(GrammarQueueFull):
        q.submit("c", "regex", "x")
    assert q.cancel("b") and not q.cancel("b") and "b" not in q
    q.submit("c", "regex", "x")
    fake.gate.set()
    got = wait_poll(q, 2)
    assert sorted(g.rid for g in got) == ["a", "c"]
    assert "slow-b" not in fake.compiles  # cancelled before a worker took it
    q.close()


def test_on_ready_wakes_the_loop(fake: FakeBackend) -> None:
    woke = threading.Event()
    q = GrammarQueue(fake, on_ready=woke.set)
    q.submit("r", "regex", "z")
    assert woke.wait(5)
    assert q.poll()[0].rid == "r"
    q.close()


def test_real_backend_roundtrip(backend) -> None:
    q = GrammarQueue(backend, timeout_s=30)
    q.submit("ok", "json_schema", '{"type": "object"}')
    q.submit("bad", "regex", "(a")
    got = {g.rid: g for g in wait_poll(q, 2, timeout=30)}
    assert got["ok"].matcher is not None
    assert got["bad"].error.startswith("sampling_params.regex: ")
    assert got["bad"].status == grpc.StatusCode.INVALID_ARGUMENT
    q.close()


def test_metrics(fake: FakeBackend) -> None:
    from prometheus_client import CollectorRegistry

    from services.scheduler.grammar import GrammarMetrics

    reg = CollectorRegistry()
    q = GrammarQueue(fake, metrics=GrammarMetrics("m", registry=reg))
    q.submit("a", "regex", "slow-m")
    assert reg.get_sample_value("sglang:num_grammar_queue_reqs", {"model_name": "m"}) == 1
    fake.gate.set()
    wait_poll(q, 1)
    q.submit("b", "regex", "slow-m")
    q.submit("c", "regex", "bad")
    wait_poll(q, 2)
    assert reg.get_sample_value("sglang:num_grammar_queue_reqs", {"model_name": "m"}) == 0
    assert reg.get_sample_value("sglang:grammar_compile_seconds_count", {"model_name": "m", "kind": "regex"}) == 2
    assert reg.get_sample_value("sglang:grammar_cache_hits_total", {"model_name": "m"}) == 1
    assert reg.get_sample_value("sglang:grammar_errors_total", {"model_name": "m", "reason": "invalid"}) == 1
    q.close()
