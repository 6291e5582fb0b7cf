"""Prompt logprobs (logprob_start_len): equal to transformers' log-softmax over the prompt, also
when the prompt is cached, chunked, or scored from the middle."""

from __future__ import annotations

import math

import pytest
import torch

from services.scheduler.config import EngineConfig
from services.scheduler.core import prompt_logprobs
from services.scheduler.core.engine import Engine
from services.scheduler.core.req import Req
from services.scheduler.model_executor.model_runner import _logit_index
from services.scheduler.model_executor.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
TOP = 3


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((5, 40, 97))]


@pytest.fixture(scope="module")
def reference(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: [n - 1, V] log-softmax of transformers' logits at positions 0..n-2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), -1) for p in prompts]


def _check(prompt: list[int], ref: torch.Tensor, got: list, start: int) -> None:
    assert len(got) == len(prompt) - start
    for pos, (tok, lp, top) in enumerate(got, start=start):
        assert tok == prompt[pos]
        if pos == 0:
            assert math.isnan(lp) and top is None
            continue
        assert lp == pytest.approx(float(ref[pos - 1, tok]), abs=1e-4)
        want_v, want_i = ref[pos - 1].topk(TOP)
        assert [v for _, v in top] == pytest.approx(want_v.tolist(), abs=1e-4)
        assert {i for i, _ in top} == set(want_i.tolist()) or len(set(want_v.tolist())) < TOP  # ties


def _engine(model_dir: str, **kw) -> Engine:
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=4096, **kw))
    engine.warmup()
    return engine


def test_prompt_logprobs_equal_transformers(model_dir: str, prompts, reference) -> None:
    engine = _engine(model_dir)
    results = engine.generate(prompts, GREEDY, return_logprob=True, top_logprobs_num=TOP, logprob_start_len=0)
    for p, ref, res in zip(prompts, reference, results):
        _check(p, ref, res.input_logprobs, 0)
        assert len(res.output_ids) == 2 and len(res.logprobs) == 2


def test_zero_new_tokens_scores_the_prompt_and_generates_nothing(model_dir: str, prompts, reference) -> None:
    engine = _engine(model_dir)
    params = SamplingParams(temperature=0.0, max_new_tokens=0)
    (res,) = engine.generate(prompts[1:2], params, return_logprob=True, top_logprobs_num=TOP, logprob_start_len=0)
    assert res.output_ids == [] and res.logprobs == [] and res.finish.type == "length"
    _check(prompts[1], reference[1], res.input_logprobs, 0)


def test_cached_chunked_and_partial_prompts_are_scored_the_same(model_dir: str, prompts, reference) -> None:
    engine = _engine(model_dir, chunked_prefill_size=16)
    engine.generate(prompts, GREEDY)  # now every prompt is in the prefix cache
    again = engine.generate(prompts, GREEDY, return_logprob=True, top_logprobs_num=TOP, logprob_start_len=0)
    for p, ref, res in zip(prompts, reference, again):
        _check(p, ref, res.input_logprobs, 0)
    start = 30  # only the tail: the cache may supply the positions before it
    tail = engine.generate(prompts[1:], GREEDY, return_logprob=True, top_logprobs_num=TOP, logprob_start_len=start)
    for p, ref, res in zip(prompts[1:], reference[1:], tail):
        _check(p, ref, res.input_logprobs, start)
        assert res.cached_tokens == start - 1
    plain = engine.generate(prompts, GREEDY, return_logprob=True)
    assert all(r.input_logprobs == [] for r in plain)


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed-chunk"])
def test_scored_once_through_retraction_and_mixed_steps(model_dir: str, prompts, reference, mixed: bool) -> None:
    """A pool too small for all of them: requests are retracted and recomputed, with 16-token chunks
    (and decode rows inside the prefill steps with mixed chunks); every prompt is still scored once,
    position by position."""
    many = [p for p in prompts for _ in range(6)]
    refs = [r for r in reference for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    engine = Engine(EngineConfig(model=model_dir, device="cpu", max_total_tokens=max(map(len, prompts)) + 160,
                                 chunked_prefill_size=16, enable_mixed_chunk=mixed))
    results = engine.generate(many, params, return_logprob=True, top_logprobs_num=TOP, logprob_start_len=0)
    assert engine.scheduler.stats.retractions > 0
    for p, ref, res in zip(many, refs, results):
        _check(p, ref, res.input_logprobs, 0)
        assert len(res.output_ids) == 64


def test_scored_positions_per_step_are_bounded(model_dir: str, prompts, reference,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A scoring request keeps logits for each new position ([rows, vocab]): its prefill is cut to the
    step's row budget even with chunked prefill off (a 128k vocabulary: 512 rows a step)."""
    assert prompt_logprobs.rows_budget(131_072) == 512 and prompt_logprobs.rows_budget(4096) == 16384
    monkeypatch.setattr(prompt_logprobs, "LOGIT_BYTES", 0)  # MIN_ROWS (64) a step
    engine = _engine(model_dir, chunked_prefill_size=0)
    (res,) = engine.generate(prompts[2:], GREEDY, return_logprob=True, top_logprobs_num=TOP, logprob_start_len=0)
    _check(prompts[2], reference[2], res.input_logprobs, 0)
    assert engine.scheduler.stats.prefill_steps == 2  # 97 positions: 64, then 33


def test_requests_scoring_the_same_prompt_prefill_together(model_dir: str, prompts, reference) -> None:
    """lm-eval sends one context with several continuations: a scoring request cannot reuse what
    another computes, so it is not held back a step to wait for the cache."""
    engine = _engine(model_dir)
    results = engine.generate([prompts[2]] * 8, GREEDY, return_logprob=True, logprob_start_len=0)
    assert engine.scheduler.stats.prefill_steps == 1
    assert all(r.input_logprobs == results[0].input_logprobs for r in results)


def test_logit_rows_cover_the_unscored_positions_of_each_chunk() -> None:
    req = Req(rid="a", origin_input_ids=list(range(10)), params=GREEDY, logprob_start_len=0)
    prompt_logprobs.seed(req)
    other = Req(rid="b", origin_input_ids=list(range(10)), params=GREEDY)
    assert prompt_logprobs.cache_cap(req) == 0 and prompt_logprobs.cache_cap(other) is None
    # A first chunk of 4 tokens: positions 0-3 all score (1-4); the other request only its last.
    assert prompt_logprobs.logit_rows([req, other], [4, 10]) == [4, 1]
    assert prompt_logprobs.logit_rows([other], [10]) is None
    assert _logit_index([4, 10], [4, 1], torch.device("cpu")).tolist() == [0, 1, 2, 3, 13]
    assert _logit_index([3, 2], None, torch.device("cpu")).tolist() == [2, 4]
    assert _logit_index([1, 1], None, torch.device("cpu")) is None
