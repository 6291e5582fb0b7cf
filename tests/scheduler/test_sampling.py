"""Sampling: parameter parsing, penalties, filters, seeds and logprobs against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from ringserve.v1 import common_pb2
from services.scheduler.model_executor.sampling import (
    LogitBias,
    SamplingBatchInfo,
    SamplingParams,
    apply_penalties,
    make_generator,
    sample,
)

V = 50


def build(params: list[SamplingParams], output_ids=None, prompt_ids=None, stop_ids=None, seeds=True):
    bs = len(params)
    return SamplingBatchInfo.build(
        params, [make_generator(p.seed, "cpu") for p in params] if seeds else [None] * bs,
        output_ids or [[] for _ in range(bs)], prompt_ids or [[] for _ in range(bs)],
        stop_ids or [set() for _ in range(bs)], V, "cpu")


def rand_logits(bs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(bs, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_from_pb_defaults_and_values() -> None:
    p = SamplingParams.from_pb(common_pb2.SamplingParams())
    assert p == SamplingParams()
    assert SamplingParams.from_pb(common_pb2.SamplingParams(top_k=0)).top_k == -1
    pb = common_pb2.SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.25, repetition_penalty=1.5,
                                   max_new_tokens=0, min_new_tokens=3, stop=["a", "b"], stop_token_ids=[4],
                                   ignore_eos=True, skip_special_tokens=False, seed=-5, no_stop_trim=True)
    p = SamplingParams.from_pb(pb)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.0, 0.5, 7, 0.25, 1.5)
    assert (p.max_new_tokens, p.min_new_tokens, p.stop, p.stop_token_ids) == (0, 3, ("a", "b"), (4,))
    assert p.ignore_eos and not p.skip_special_tokens and p.spaces_between_special_tokens
    assert p.seed == -5 and p.no_stop_trim and p.is_greedy
    assert SamplingParams(top_k=1).is_greedy and not SamplingParams().is_greedy


def test_greedy_fast_path_and_top_k_1() -> None:
    logits = rand_logits(4)
    info = build([SamplingParams(temperature=0.0)] * 4)
    assert info.fast_greedy and info.temperatures is None
    want = logits.argmax(-1).tolist()
    assert sample(logits, info, [False] * 4, [0] * 4).next_token_ids == want
    info = build([SamplingParams(top_k=1, temperature=1.3), SamplingParams(temperature=0.0, seed=3)] * 2)
    assert sample(logits, info, [False] * 4, [0] * 4).next_token_ids == want


@pytest.mark.parametrize("params", [SamplingParams(top_k=5), SamplingParams(top_p=0.6),
                                    SamplingParams(min_p=0.2, temperature=0.7),
                                    SamplingParams(top_k=8, top_p=0.9, min_p=0.05, temperature=1.5)])
def test_filters_never_emit_outside_allowed_set(params: SamplingParams) -> None:
    logits = rand_logits(3, seed=1)
    probs = torch.softmax(logits / params.temperature, -1)
    allowed = []
    for row in probs:
        order = row.argsort(descending=True).tolist()
        keep = set()
        mass = 0.0
        for rank, t in enumerate(order):
            ok = (params.top_k < 0 or rank < params.top_k) and mass <= params.top_p \
                and row[t] >= params.min_p * row.max()
            if ok:
                keep.add(t)
            mass += float(row[t])
        allowed.append(keep)
    info = build([params] * 3, seeds=False)
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        for i, t in enumerate(sample(logits, info, [False] * 3, [0] * 3).next_token_ids):
            seen[i].add(t)
    for i in range(3):
        assert seen[i] <= allowed[i], (seen[i] - allowed[i])
        assert len(seen[i]) >= min(2, len(allowed[i]))  # it does sample, not just argmax


def test_penalties_match_hand_computation() -> None:
    logits = rand_logits(2, seed=2)
    prompt = [[1, 2, 3], [4]]
    output = [[3, 3, 5], [4, 4, 4, 6]]
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0)]
    got = apply_penalties(logits, build(params, output, prompt))
    want = logits.clone()
    for i, p in enumerate(params):
        for t in set(prompt[i] + output[i]):
            x = float(want[i, t])
            want[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(output[i]):
            c = output[i].count(t)
            want[i, t] -= p.frequency_penalty * c + p.presence_penalty
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not torch.equal(got, logits)


def test_min_new_tokens_masks_stop_ids() -> None:
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0  # EOS would win
    params = [SamplingParams(temperature=0.0, min_new_tokens=2)] * 2
    info = build(params, output_ids=[[1], [1, 2]], stop_ids=[{7}, {7}])
    assert not info.fast_greedy
    out = sample(logits, info, [False, False], [0, 0]).next_token_ids
    assert out[0] != 7 and out[1] == 7


def test_same_seed_same_tokens_alone_and_in_batch() -> None:
    logits = rand_logits(4, seed=3)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(batch_params: list[SamplingParams], row: int, steps: int = 20) -> list[int]:
        gens = [make_generator(p.seed, "cpu") for p in batch_params]
        toks = []
        for _ in range(steps):
            info = SamplingBatchInfo.build(batch_params, gens, [[] for _ in batch_params],
                                           [[] for _ in batch_params], [set() for _ in batch_params], V, "cpu")
            toks.append(sample(logits[: len(batch_params)], info, [False] * len(batch_params),
                               [0] * len(batch_params)).next_token_ids[row])
        return toks

    alone = run([seeded], 0)
    logits[2] = logits[0]
    mixed = run([SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=9), seeded,
                 SamplingParams(temperature=0.0)], 2)
    assert alone == mixed
    assert len(set(alone)) > 1
    assert run([SamplingParams(temperature=1.0, top_p=0.95, seed=99)], 0) != alone


def test_logprobs_from_raw_logits() -> None:
    logits = rand_logits(3, seed=4)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.5),
              SamplingParams(temperature=0.0)]
    out = sample(logits, build(params, prompt_ids=[[int(logits[0].argmax())], [], []]),
                 [True, True, False], [3, 0, 5])
    ref = torch.log_softmax(logits, -1)
    for i in range(2):
        assert math.isclose(out.logprobs[i], float(ref[i, out.next_token_ids[i]]), abs_tol=1e-4)
    assert out.logprobs[2] is None and out.top_logprobs[1] is None
    assert out.next_token_ids[0] != int(logits[0].argmax())  # the penalty moved the choice, not the logprob
    for i, n in ((0, 3), (2, 5)):
        tops = out.top_logprobs[i]
        assert [t for t, _ in tops] == ref[i].argsort(descending=True)[:n].tolist()
        assert all(math.isclose(lp, float(ref[i, t]), abs_tol=1e-4) for t, lp in tops)
        assert [lp for _, lp in tops] == sorted((lp for _, lp in tops), reverse=True)


def test_logit_bias_forces_greedy_and_leaves_unbiased_rows_alone() -> None:
    logits = rand_logits(4, seed=5)
    want = logits.argmax(-1).tolist()
    forced = [t for t in range(V) if t != want[1]][7]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias=((forced, 100.0),)),
              SamplingParams(temperature=0.0), SamplingParams(top_k=1, logit_bias=((3, 1e-3),))]
    info = build(params)
    assert not info.fast_greedy and info.bias_index is not None
    assert info.bias_index.tolist() == [1 * V + forced, 3 * V + 3]  # only the biased rows' entries
    raw = logits.clone()
    out = sample(logits, info, [True] * 4, [0] * 4)
    assert out.next_token_ids[:3] == [want[0], forced, want[2]]
    assert logits[1, forced] == raw[1, forced] + 100.0  # added in place: no copy of the whole batch
    assert torch.equal(logits[0], raw[0]) and torch.equal(logits[2], raw[2])
    # Logprobs stay the raw distribution's (vLLM's default), not the biased one's.
    assert math.isclose(out.logprobs[1], float(torch.log_softmax(raw[1], -1)[forced]), abs_tol=1e-5)


def test_logit_bias_minus_100_bans_a_token() -> None:
    logits = torch.zeros(2, V)
    logits[:, 5] = 8.0   # the clear favourite: about 3/4 of the mass at temperature 1
    params = [SamplingParams(temperature=0.0, logit_bias=((5, -100.0),)),
              SamplingParams(temperature=1.0, seed=7, logit_bias=((5, -100.0), (9, 2.0)))]
    for _ in range(50):
        out = sample(logits.clone(), build(params), [False, False], [0, 0]).next_token_ids
        assert 5 not in out
    unbiased = [SamplingParams(temperature=1.0, seed=7)]
    assert 5 in [sample(logits[:1], build(unbiased), [False], [0]).next_token_ids[0] for _ in range(20)]


def test_logit_bias_added_after_penalties_and_before_the_min_tokens_mask() -> None:
    logits = rand_logits(1, seed=6)
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, min_new_tokens=3,
                       logit_bias=((2, 50.0), (4, 100.0)))
    info = build([p], prompt_ids=[[2, 3]], stop_ids=[{4}])
    got = apply_penalties(logits.clone(), info)
    want = logits.clone()
    want[0, 2] = (want[0, 2] / 1.5 if want[0, 2] > 0 else want[0, 2] * 1.5) + 50.0
    want[0, 3] = want[0, 3] / 1.5 if want[0, 3] > 0 else want[0, 3] * 1.5
    want[0, 4] = float("-inf")  # a stop id under min_new_tokens stays masked whatever its bias
    torch.testing.assert_close(got, want)
    assert sample(logits, info, [False], [0]).next_token_ids == [2]


def test_logit_bias_tensors_kept_while_the_biased_rows_stay() -> None:
    cache = LogitBias()
    a = SamplingParams(logit_bias=((1, 2.0), (4, -1.0)))
    b = SamplingParams(logit_bias=((0, 5.0),))
    plain = SamplingParams()
    assert cache.tensors([plain, plain], V, "cpu") is None  # rows without a bias build nothing
    first = cache.tensors([plain, a, b], V, "cpu")
    assert first is not None
    assert first[0].tolist() == [V + 1, V + 4, 2 * V] and first[1].tolist() == [2.0, -1.0, 5.0]
    assert cache.tensors([plain, a, b], V, "cpu") is first        # same composition: no rebuild
    moved = cache.tensors([a, b], V, "cpu")                        # a row finished: the rows moved
    assert moved is not None and moved[0].tolist() == [1, 4, V]
    assert cache.tensors([plain, a, b], V, "cpu") is first        # alternating batches keep theirs
    for i in range(LogitBias.KEEP + 1):
        cache.tensors([SamplingParams(logit_bias=((i, 1.0),))], V, "cpu")
    assert len(cache._built) == LogitBias.KEEP
