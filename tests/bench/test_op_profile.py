"""bench.op_profile on the tiny model: every op family is timed once, nests are not counted twice."""

from __future__ import annotations

import re

import pytest

from bench import op_profile


def test_nested_timed_calls_count_once() -> None:
    class Obj:
        def outer(self) -> int:
            return self.inner() + 1

        def inner(self) -> int:
            return 1

    timers = op_profile.Timers()
    o = Obj()
    timers.wrap(o, "inner", "inner")
    timers.wrap(o, "outer", "outer")
    assert o.outer() == 2 and o.inner() == 1
    assert set(timers.seconds) == {"outer", "inner"}  # inner counted only when called alone
    assert timers.depth == 0


def test_profile_prints_every_family(model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert op_profile.main(["--model", model_dir, "--batches", "2", "--context", "16", "--prefill", "16",
                            "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "### prefill, 1 x 16 tokens" in out and "### decode, batch 2" in out
    for family in ("attention", "linear qkv_proj", "linear o_proj", "linear gate_up_proj", "linear down_proj",
                   "norms", "rotary", "sampling", "scheduling", "other in the forward"):
        assert f"| {family} |" in out, family
    assert re.search(r"step / that = \d+\.\d\dx", out)
