"""The wire vocabulary: every type survives its hop unchanged, and an unset sampling field means its default."""

from __future__ import annotations

import grpc
from hypothesis import given
from hypothesis import strategies as st

from ringserve.message import (
    DecodeParams,
    Finish,
    Load,
    Logprob,
    SamplingParams,
    StepBatch,
    TextDelta,
    Timings,
    TokenDelta,
    TokenizedReq,
)
from ringserve.v1 import common_pb2, detokenizer_pb2


def f32(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Multiples of 1/64: exact in float32, as the proto carries them."""
    return st.integers(int(lo * 64), int(hi * 64)).map(lambda i: i / 64)


params = st.builds(
    SamplingParams, temperature=f32(0, 2), top_p=f32(0.02, 1),
    top_k=st.sampled_from([-1, 1, 5, 50]), min_p=f32(0, 1), frequency_penalty=f32(-2, 2),
    presence_penalty=f32(-2, 2), repetition_penalty=f32(0.5, 2), max_new_tokens=st.integers(0, 4096),
    min_new_tokens=st.integers(0, 16), stop=st.lists(st.text(max_size=5), max_size=3).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 5000), max_size=3).map(tuple), ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(), spaces_between_special_tokens=st.booleans(),
    seed=st.none() | st.integers(-2**63, 2**63 - 1), no_stop_trim=st.booleans(),
    regex=st.none() | st.just("[a-z]+"),
    logit_bias=st.dictionaries(st.integers(0, 5000), f32(-100, 100), max_size=4).map(
        lambda d: tuple(sorted(d.items()))),
    stop_regex=st.lists(st.text(max_size=5), max_size=3).map(tuple))


@given(params)
def test_round_trip(p: SamplingParams) -> None:
    assert SamplingParams.from_pb(p.to_pb()) == p


def test_unset_fields_take_the_defaults() -> None:
    assert SamplingParams.from_pb(common_pb2.SamplingParams()) == SamplingParams()
    assert SamplingParams.from_pb(common_pb2.SamplingParams(top_k=0)).top_k == -1


def test_resolve_fixes_max_new_tokens_and_expands_n() -> None:
    p = SamplingParams(n=3, seed=7)
    assert p.max_new_tokens is None and p.max_tokens == 128  # unset: the default, written once
    assert [p.resolve(16, i) for i in range(3)] == [SamplingParams(max_new_tokens=16, seed=7 + i) for i in range(3)]


def test_ring_messages_round_trip() -> None:
    sp = SamplingParams(temperature=0.5, stop=("x",), max_new_tokens=9)
    lp = Logprob(5, -0.25, ((5, -0.25), (6, -1.5)))
    finish = Finish.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    timings = Timings(queue_s=0.5, decode_s=1.25)
    delta = TokenDelta(rid="r", ids=[5, 6], offset=3, params=DecodeParams("tok-1", sp, stream=True, prompt_tokens=4),
                       finish=finish, logprobs=[lp, Logprob(6, -0.5)], cached_tokens=2, timings=timings,
                       input_logprobs=[Logprob(1, float("-inf"))], weight_version="v2")
    assert StepBatch.from_pb(StepBatch([delta], sent_at=1.5, resync=True).to_pb()) == StepBatch([delta], 1.5, True)
    text = TextDelta(rid="r", token_offset=3, ids=[5, 6], text_offset=1, text="ab", logprobs=[lp], finish=finish,
                     prompt_tokens=4, cached_tokens=2, timings=timings, weight_version="v2")
    resp = detokenizer_pb2.SubscribeResponse()
    text.add_to(resp)
    assert TextDelta.from_pb(resp.deltas[0]) == text
    assert Finish.from_pb(Finish("stop", matched_str="x").to_pb()) == Finish("stop", matched_str="x")
    load = Load(num_running_reqs=3, num_queue_reqs=1, max_total_num_tokens=100, num_used_tokens=50, token_usage=0.5)
    assert Load.from_pb(load.to_pb()) == load and load.num_reqs == 4
    req = TokenizedReq(rid="r", owner="o", input_ids=[1, 2], sampling=sp, stream=True, logprob_start_len=0)
    assert TokenizedReq.from_pb(req.to_pb(sent_at=2.0)) == TokenizedReq(**{**req.__dict__, "sent_at": 2.0})
