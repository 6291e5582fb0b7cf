"""bench.targets' repeats: the two servers taking turns, and a workload's runs kept across calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from bench import targets
from bench.stats import RequestRecord
from bench.targets import Measure, RunResult, Runs, _measure, run_model
from bench.workloads import Workload

MODEL = Path("/models/SmolLM2-135M-Instruct")
W = Workload("B", "t", num_prompts=4, input_len=8, output_len=10, max_concurrency=4, seed=2)


def fake_run(throughputs: dict[int, float], calls: list[tuple[int, bool]],
             fail_at: int | None = None) -> Callable[[Workload, bool], tuple[list[RequestRecord], float]]:
    """A run function whose output tok/s depends on the seed's repeat: 100 tokens in 100 / tok_s seconds."""
    def run(w: Workload, warm: bool) -> tuple[list[RequestRecord], float]:
        rep = (w.seed - W.seed) // targets.REPEAT_SEED_STEP
        calls.append((rep, warm))
        if rep == fail_at:
            raise RuntimeError("server went away")
        return [RequestRecord(ok=True, prompt_len=8, output_len=100, ttft=0.1, itls=[0.01] * 99, e2e=1.0)], \
            100 / throughputs[rep]
    return run


def test_a_workloads_runs_add_up_across_calls_and_the_median_is_reported() -> None:
    runs, emitted, calls = Runs(), list[RunResult](), list[tuple[int, bool]]()
    fn = fake_run({0: 300.0, 1: 100.0, 2: 200.0}, calls)
    for rep in range(3):  # one repetition a call, as run_model makes them when the servers take turns
        _measure("gateway", MODEL, W, fn, emitted.append, range(rep, rep + 1), runs)
    assert calls == [(0, True), (1, False), (2, False)]  # one warm-up request per server and workload
    assert [len(r.extra["output_throughput_runs"]) for r in emitted] == [1, 2, 3]
    last = emitted[-1]
    assert last.status == "ok" and last.extra["output_throughput_runs"] == [300.0, 100.0, 200.0]
    assert last.summary is not None and last.summary["output_throughput"] == pytest.approx(200.0)


def test_the_step_profile_leaves_out_the_warm_up_run_when_there_are_others() -> None:
    counters = iter(range(100))

    def profile() -> dict[str, float]:  # decode steps counted so far: the first run takes 1, the others 10
        n = next(counters)
        return {"decode_steps": float([0, 1, 1, 11, 11, 21][n]), "decode_s": 0.0, "decode_rows": 0.0,
                "prefill_steps": 0.0, "prefill_s": 0.0}

    runs, emitted, calls = Runs(), list[RunResult](), list[tuple[int, bool]]()
    fn = fake_run({0: 1.0, 1: 1.0, 2: 1.0}, calls)
    _measure("gateway", MODEL, W, fn, emitted.append, range(0, 1), runs, profile)
    assert emitted[-1].extra["step_profile"]["decode_steps"] == 1  # one run: the warm-up run's own
    for rep in (1, 2):
        _measure("gateway", MODEL, W, fn, emitted.append, range(rep, rep + 1), runs, profile)
    assert emitted[-1].extra["step_profile"]["decode_steps"] == 20
    assert emitted[-1].extra["step_profile_runs"] == 2


def test_one_call_runs_its_repeats_and_warms_up_once() -> None:
    runs, emitted, calls = Runs(), list[RunResult](), list[tuple[int, bool]]()
    _measure("vllm", MODEL, W, fake_run({0: 1.0, 1: 2.0, 2: 3.0}, calls), emitted.append, range(3), runs)
    assert calls == [(0, True), (1, False), (2, False)]
    assert len(emitted) == 1 and emitted[0].extra["output_throughput_runs"] == [1.0, 2.0, 3.0]


def test_a_failed_run_ends_the_workload_on_that_target() -> None:
    runs, emitted, calls = Runs(), list[RunResult](), list[tuple[int, bool]]()
    fn = fake_run({0: 1.0, 1: 1.0, 2: 1.0}, calls, fail_at=1)
    for rep in range(3):
        _measure("gateway", MODEL, W, fn, emitted.append, range(rep, rep + 1), runs)
    assert [r.status for r in emitted] == ["ok", "failed"]
    assert "server went away" in emitted[-1].note
    assert [rep for rep, _ in calls] == [0, 1]  # the third repetition does not run it again


def fake_sessions(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    def session(name: str, starts: bool = True) -> Callable[..., AbstractContextManager[Measure | None]]:
        @contextmanager
        def run(*args: object, **kwargs: object) -> Iterator[Measure | None]:
            events.append(f"start {name}")
            try:
                yield (lambda w, reps: events.append(f"{name} {w.name} {list(reps)}")) if starts else None
            finally:
                events.append(f"stop {name}")
        return run

    monkeypatch.setattr(targets, "ringserve_session", session("ringserve"))
    monkeypatch.setattr(targets, "vllm_session", session("vllm"))
    monkeypatch.setattr(targets, "run_engine", lambda *a, **k: events.append("engine"))


def test_ringserve_and_vllm_take_turns_on_every_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    fake_sessions(monkeypatch, events)
    b = replace(W, name="C")
    run_model(["gateway", "engine", "vllm"], MODEL, [W, b], False, Path("/tmp"), lambda r: None, repeats=2)
    assert events == ["start ringserve", "start vllm",
                      "ringserve B [0]", "vllm B [0]", "ringserve C [0]", "vllm C [0]",
                      "ringserve B [1]", "vllm B [1]", "ringserve C [1]", "vllm C [1]",
                      "stop vllm", "stop ringserve", "engine"]  # the engine alone on the machine


def test_one_server_alone_runs_its_repeats_in_one_go(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    fake_sessions(monkeypatch, events)
    run_model(["gateway"], MODEL, [W], False, Path("/tmp"), lambda r: None, repeats=3)
    assert events == ["start ringserve", "ringserve B [0, 1, 2]", "stop ringserve"]
    events.clear()
    run_model(["gateway", "vllm"], MODEL, [W], False, Path("/tmp"), lambda r: None, repeats=1)
    assert events == ["start ringserve", "ringserve B [0]", "stop ringserve", "start vllm", "vllm B [0]", "stop vllm"]
