"""bench.hop_floor: the bare chains of streams the ring's CPU per token is read against."""

from __future__ import annotations

import math

from bench.hop_floor import KINDS, measure


def test_hop_floor_runs_both_chains() -> None:
    """The bare chains for real, briefly: every process starts, passes the messages on and reports."""
    for kind in KINDS:
        f = measure(kind, rate=500.0, rows=3, messages=40)
        assert (f.kind, f.rows) == (kind, 3)
        assert 0 < f.relay_us < 1e5 and 0 < f.sink_us < 1e5
        assert math.isclose(f.ring_us_per_token, (2 * f.relay_us + f.sink_us) / 3)
