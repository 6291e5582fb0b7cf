"""The scheduler's entry point sets the OpenMP wait (services/scheduler/__main__.py): where it applies, and
that it can reach libgomp (set before anything loads torch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.scheduler import __main__ as entry

CPUS = len(os.sched_getaffinity(0))


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    return monkeypatch


@pytest.mark.parametrize(("decode_threads", "num_threads", "spins"), [
    (None, None, True),          # decode and prefill on every thread torch uses
    (2, 2, True),
    (CPUS, None, True),
    (1, 2, False),               # decode on fewer: a worker spinning after prefill would hold a core
    (1, None, CPUS == 1),
])
def test_long_spin_only_where_decode_uses_every_thread(env: pytest.MonkeyPatch, decode_threads: int | None,
                                                      num_threads: int | None, spins: bool) -> None:
    entry.set_openmp_wait(decode_threads, num_threads)
    assert os.environ.get("GOMP_SPINCOUNT") == (entry.SPIN_COUNT if spins else None)


@pytest.mark.parametrize(("var", "value", "spin"), [("GOMP_SPINCOUNT", "1000", "1000"),
                                                    ("OMP_WAIT_POLICY", "PASSIVE", None)])
def test_a_setting_the_user_made_is_kept(env: pytest.MonkeyPatch, var: str, value: str, spin: str | None) -> None:
    env.setenv(var, value)
    entry.set_openmp_wait(None, None)
    assert os.environ.get("GOMP_SPINCOUNT") == spin


def test_the_entry_point_loads_no_torch_before_it_applies_them() -> None:
    probe = "import sys; import services.scheduler.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.split() == ["False"]
