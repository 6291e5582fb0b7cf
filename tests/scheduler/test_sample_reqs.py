"""sample_reqs: a batch of Req objects through the sampler (unit, CPU, no model)."""

from __future__ import annotations

import math

import torch

from services.scheduler.core.finish import FinishChecker
from services.scheduler.core.req import Req
from services.scheduler.core.scheduler import argmax_only, sample_reqs
from services.scheduler.grammar.glue import GrammarGlue
from services.scheduler.model_executor.sampling import SamplingParams

V, EOS = 8, 7
FINISHER = FinishChecker(None, [EOS], 100)


def run(reqs: list[Req], logits: torch.Tensor) -> list[int]:
    return sample_reqs(reqs, logits, GrammarGlue(None, None), FINISHER, V, torch.device("cpu"))


def test_greedy_rows_and_logprobs_recorded_per_request() -> None:
    logits = torch.tensor([[0.0, 3, 1, 0, 0, 0, 0, 0], [0.0, 0, 0, 0, 5, 0, 0, 0]])
    a = Req("a", [1, 2], SamplingParams(temperature=0.0), return_logprob=True, top_logprobs_num=2)
    b = Req("b", [3], SamplingParams(temperature=0.0))
    assert run([a, b], logits) == [1, 4]
    (lp,), (top,) = a.output_logprobs, a.output_top_logprobs
    assert math.isclose(lp, torch.log_softmax(logits[0], -1)[1].item(), rel_tol=1e-5)
    assert [t for t, _ in top] == [1, 2]
    assert b.output_logprobs == [] and b.output_top_logprobs == []


def test_min_new_tokens_keeps_eos_out_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS] = 9.0
    logits[0, 2] = 1.0
    early = Req("e", [1], SamplingParams(temperature=0.0, min_new_tokens=2))
    assert run([early], logits.clone()) == [2]
    early.output_ids = [2, 2]  # reached: EOS may come now
    assert run([early], logits.clone()) == [EOS]


def test_no_requests_no_tokens() -> None:
    assert run([], torch.zeros(0, V)) == []


def test_argmax_only_batches_take_the_forwards_ids() -> None:
    """A batch argmax_only() passes may get [B] argmax ids from the forward (ForwardBatch.greedy); anything
    that reads the logits or samples keeps the batch off it."""
    def req(**kw) -> Req:
        fields = {k: kw.pop(k) for k in ("return_logprob", "top_logprobs_num") if k in kw}
        return Req("r", [1], SamplingParams(**{"temperature": 0.0, **kw}), **fields)

    plain = [req(), req(max_new_tokens=3)]
    assert argmax_only(plain)
    assert run(plain, torch.tensor([5, 2])) == [5, 2]
    for other in (req(temperature=0.7), req(return_logprob=True), req(top_logprobs_num=1),
                  req(repetition_penalty=1.1), req(frequency_penalty=0.5), req(logit_bias=[(1, 2.0)]),
                  req(min_new_tokens=2)):
        assert not argmax_only([*plain, other])
    constrained = req()
    constrained.grammar = object()
    assert not argmax_only([constrained])
    reached = req(min_new_tokens=2)
    reached.output_ids = [3, 4]
    assert argmax_only([reached])
