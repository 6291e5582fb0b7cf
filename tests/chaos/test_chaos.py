"""Services killed at random moments under a steady streaming load on the real default model;
the invariants in tests/chaos/harness.py hold after every round.

Short (in `make test`): four rounds, each kind of service killed once. Long (`make chaos`, marker
`chaos`): RINGSERVE_CHAOS_S (default 600) seconds.
RINGSERVE_CHAOS_SEED replays a run's rounds (request mix, victims, kill and restart moments).
"""

from __future__ import annotations

import os
import random

import pytest

from tests.chaos.harness import VICTIMS, chaos_ring

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _seed() -> int:
    raw = os.environ.get("RINGSERVE_CHAOS_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(1 << 31)


def _run(real_model_dir: str, duration_s: float, per_round: int) -> None:
    seed = _seed()
    print(f"\nchaos: RINGSERVE_CHAOS_SEED={seed} replays this run", flush=True)
    with chaos_ring(real_model_dir, seed) as chaos:
        report = chaos.run(duration_s, per_round)
    print(report.summary(), flush=True)
    for v in report.violations:
        print("VIOLATION", v)
    assert not report.violations, f"{report.summary()} (RINGSERVE_CHAOS_SEED={seed}):\n" + "\n".join(
        report.violations[:20])
    assert all(report.kills[v] >= 1 for v in VICTIMS), report.summary()


def test_chaos_short(real_model_dir: str) -> None:
    _run(real_model_dir, 0.0, per_round=4)


@pytest.mark.chaos
def test_chaos(real_model_dir: str) -> None:
    _run(real_model_dir, float(os.environ.get("RINGSERVE_CHAOS_S", "600")), per_round=6)
