"""The scheduler's OpenMP wait reaches libgomp: set before torch is imported (services/scheduler/omp_env.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.scheduler import omp_env

PROBE = ("import os, sys; import services.scheduler; loaded = 'torch' in sys.modules; "
         "import services.scheduler.server; print(loaded, os.environ.get('GOMP_SPINCOUNT'))")


def probe(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, check=True, capture_output=True,
                          text=True).stdout.split()


def test_the_scheduler_package_sets_it_before_torch_is_imported() -> None:
    assert probe() == ["False", omp_env.SPIN_COUNT]


@pytest.mark.parametrize(("var", "value", "spin"), [("GOMP_SPINCOUNT", "1000", "1000"),
                                                    ("OMP_WAIT_POLICY", "PASSIVE", "None")])
def test_a_setting_the_user_made_is_kept(var: str, value: str, spin: str) -> None:
    assert probe(**{var: value}) == ["False", spin]
