"""How the launcher splits a CPU-only machine between the forward and the I/O services."""

from __future__ import annotations

import sys

import pytest

from ringserve import cpu_layout
from ringserve.cpu_layout import CpuLayout, plan, scheduler_on_cpu
from ringserve.process import ServiceProcess


def test_auto_keeps_one_core_per_eight_for_the_io_services() -> None:
    assert plan(-1, True, {0, 1}) == CpuLayout(io_cpus=frozenset({1}), decode_threads=1)
    assert plan(-1, True, set(range(16))) == CpuLayout(io_cpus=frozenset({14, 15}), decode_threads=14)
    # Only the cores this process may use count (a container's cpuset).
    assert plan(-1, True, {4, 5, 6}) == CpuLayout(io_cpus=frozenset({6}), decode_threads=2)


def test_auto_keeps_one_core_per_64_for_a_model_whose_forward_dominates() -> None:
    big, small = cpu_layout.LARGE_MODEL_PARAMS, cpu_layout.LARGE_MODEL_PARAMS - 1
    assert plan(-1, True, {0, 1}, model_params=big) is None
    assert plan(-1, True, set(range(63)), model_params=big) is None
    assert plan(-1, True, set(range(128)), model_params=big) == CpuLayout(io_cpus=frozenset({126, 127}),
                                                                         decode_threads=126)
    assert plan(-1, True, {0, 1}, model_params=small) == CpuLayout(io_cpus=frozenset({1}), decode_threads=1)
    # An explicit count is kept whatever the model.
    assert plan(1, True, {0, 1}, model_params=big) == CpuLayout(io_cpus=frozenset({1}), decode_threads=1)


def test_explicit_count_leaves_the_forward_at_least_one_core() -> None:
    assert plan(3, True, {0, 1, 2, 3}) == CpuLayout(io_cpus=frozenset({1, 2, 3}), decode_threads=1)
    assert plan(5, True, {0, 1}) == CpuLayout(io_cpus=frozenset({1}), decode_threads=1)


@pytest.mark.parametrize("io_cores, on_cpu, cpus", [(0, True, {0, 1}), (-1, False, {0, 1}), (-1, True, {0})])
def test_nothing_pinned_when_off_on_a_gpu_or_on_one_core(io_cores: int, on_cpu: bool, cpus: set[int]) -> None:
    assert plan(io_cores, on_cpu, cpus) is None


def test_scheduler_device_from_its_flags_then_env_then_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RINGSERVE_DEVICE", raising=False)
    monkeypatch.setattr(cpu_layout, "GPU_DEVICE_FILES", ())
    assert scheduler_on_cpu("")
    assert not scheduler_on_cpu("--stream-interval 2 --device cuda:1")
    assert scheduler_on_cpu("--device=cpu")
    monkeypatch.setenv("RINGSERVE_DEVICE", "cuda")
    assert not scheduler_on_cpu("")
    assert scheduler_on_cpu("--device cpu")  # the flag wins over the environment
    monkeypatch.delenv("RINGSERVE_DEVICE")
    monkeypatch.setattr(cpu_layout, "GPU_DEVICE_FILES", (sys.executable,))  # a path that exists
    assert not scheduler_on_cpu("")


def test_service_process_runs_on_its_cores() -> None:
    import os

    core = max(os.sched_getaffinity(0))
    code = "import os, threading; t = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0))));" \
           "t.start(); t.join()"
    proc = ServiceProcess("pinned", [sys.executable, "-c", code], cpus=frozenset({core})).start()
    assert proc.proc is not None and proc.proc.wait(timeout=30) == 0
    assert proc.wait_output(f"[{core}]", timeout=10)
