"""bench.op_profile on the tiny model: every op family is timed once, nests are not counted twice."""

from __future__ import annotations

import re

import pytest
import torch

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


def test_prefill_of_more_requests_than_the_decode_batch_is_one_step(model_dir: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The engine admits every profiled prefill request at once: with room for only the largest decode
    batch, 4 requests prefilled one a step and the table read as one slow step."""
    assert op_profile.main(["--model", model_dir, "--batches", "1", "--context", "8", "--prefill", "16",
                            "--prefill-requests", "4", "--steps", "1"]) == 0
    assert "### prefill, 4 x 16 tokens" in capsys.readouterr().out


def test_a_prefill_split_over_steps_is_refused(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(op_profile, "fill", lambda *a, **k: (["r"], 2))
    with pytest.raises(SystemExit, match="took 2 steps, not one"):
        op_profile.main(["--model", model_dir, "--batches", "1", "--context", "8", "--prefill", "16"])


def test_profile_times_the_one_call_stack_after_the_ops(model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """bf16 linears on CPU: the ops are timed on the Python layers, then the same batch through the stack."""
    from services.scheduler.kernels import cpu_linear
    from services.scheduler.kernels.cpu_kernels import load

    if not cpu_linear.supported(torch.bfloat16) or load() is None:
        pytest.skip("no oneDNN bf16 linear or no C compiler")
    assert op_profile.main(["--model", model_dir, "--batches", "9", "--context", "16", "--prefill", "0",
                            "--steps", "2", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "| linear down_proj |" in out and "| norms |" in out  # not hidden inside the stack's call
    assert re.search(r"the same step with the one-call native decode stack \(as served\): \d+\.\d\d ms; / the "
                     r"linears alone at the \w+ GEMM rate = \d+\.\d\dx", out)
