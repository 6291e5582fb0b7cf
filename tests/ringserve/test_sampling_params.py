"""SamplingParams survive the tokenizer -> scheduler hop unchanged, and unset means default."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ringserve.sampling_params import SamplingParams
from ringserve.v1 import common_pb2


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
    regex=st.none() | st.just("[a-z]+"))


@given(params)
def test_round_trip(p: SamplingParams) -> None:
    assert SamplingParams.from_pb(p.to_pb()) == p


def test_unset_fields_take_the_defaults() -> None:
    assert SamplingParams.from_pb(common_pb2.SamplingParams()) == SamplingParams()
    assert SamplingParams.from_pb(common_pb2.SamplingParams(top_k=0)).top_k == -1
