"""bench/gpu_check.py end to end on CPU (--cpu-smoke: tiny shapes, every leg but CUDA specifics), and its
deadline: the watchdog ends the run with the report so far whatever a leg is doing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu-smoke", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_cpu_smoke_parity_and_decode_legs() -> None:
    # The torch backend only: the Triton legs in the interpreter take ~1 min (the slow test below). One
    # model (the MQA one with an untied head): each leg runs per model the same way, so a second model
    # adds time, not a check; test_cpu_smoke_every_leg runs both.
    r = run("--backends", "torch", "--legs", "parity,overlap,decode", "--models", "tiny-b", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    report = r.stdout.split("==== gpu_check report ====")[1]
    assert "model tiny-b" in report and "tiny-a" not in report
    assert report.count(" PASS ") == 2  # graphs on/off (emulated graphs on CPU)
    assert report.count("of the HBM bound") == 2  # batch 1 and 4
    assert "overlap tiny-b: greedy outputs IDENTICAL on/off" in report


def test_unknown_model_is_refused_naming_the_flag() -> None:
    r = run("--models", "tiny-b,nope", timeout=60)
    assert r.returncode == 2 and "--models: nope not among tiny-a, tiny-b" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RINGSERVE_GPU_CHECK_SMOKE") != "1",
                    reason="~2 min (Triton interpreted, four services started): RINGSERVE_GPU_CHECK_SMOKE=1 runs it")
def test_cpu_smoke_every_leg() -> None:
    r = run(timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    report = r.stdout.split("==== gpu_check report ====")[1]
    assert report.count(" PASS ") == 8 and "triton" in report and "output tok/s through the four services" in report


def test_deadline_cuts_the_run_and_prints_the_report() -> None:
    r = run("--deadline-s", "1", timeout=60)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "DEADLINE: 1s reached" in r.stdout and "==== gpu_check report ====" in r.stdout
