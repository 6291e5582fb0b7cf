"""ReqState keeps only new output: duplicate or overlapping deltas (resync from offset 0) add nothing twice."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from ringserve.message import Finish, Logprob, SamplingParams, TextDelta, TokenizedReq
from services.tokenizer.request_state import ReqState


def state() -> ReqState:
    req = TokenizedReq(rid="r", owner="o", input_ids=[1], sampling=SamplingParams(), stream=True,
                       return_logprob=False, top_logprobs_num=0)
    return ReqState(req=req, group="r", index=0, scheduler="s", event=asyncio.Event())


def delta(tok_off: int, ids: list[int], text_off: int, text: str, finish: bool = False) -> TextDelta:
    return TextDelta(rid="r", token_offset=tok_off, ids=ids, text_offset=text_off, text=text,
                     logprobs=[Logprob(i, -1.0) for i in ids], finish=Finish("length") if finish else None)


def test_resync_from_zero_is_deduplicated():
    s = state()
    assert s.apply(delta(0, [1, 2], 0, "ab")) == 2
    assert s.apply(delta(0, [1, 2], 0, "ab")) == 0  # exact duplicate
    assert s.apply(delta(0, [1, 2, 3], 0, "abc")) == 1  # resync with one more
    assert s.apply(delta(2, [3, 4], 2, "cd")) == 1  # overlap
    chunk = s.take()
    assert chunk.ids == [1, 2, 3, 4] and chunk.text == "abcd" and [lp.token_id for lp in chunk.logprobs] == [1, 2, 3, 4]
    assert s.take().empty()


def test_text_can_lag_ids():
    s = state()
    s.apply(delta(0, [1, 2], 0, ""))  # text held back (half a character)
    s.apply(delta(2, [3], 0, "xé"))
    s.apply(delta(0, [1, 2, 3], 0, "xé"))  # resync
    chunk = s.take()
    assert chunk.ids == [1, 2, 3] and chunk.text == "xé" and s.num_chars == 2


def test_nothing_after_finish():
    s = state()
    s.apply(delta(0, [1], 0, "a", finish=True))
    assert s.finished and s.finish == Finish("length")
    assert s.apply(delta(1, [2], 1, "b")) == 0
    assert s.take().text == "a"


@given(st.lists(st.integers(0, 30), min_size=1, max_size=15))
def test_any_replay_order_of_prefixes_gives_the_full_output(cuts):
    """Deltas are prefixes/suffixes of one output, replayed from arbitrary earlier offsets."""
    full_ids = list(range(100, 131))
    full_text = "".join(chr(0x3b1 + i % 20) for i in range(31))
    s = state()
    received = 0
    for cut in cuts:
        end = max(received, cut)
        start = min(cut, received)  # never leaves a gap
        s.apply(delta(start, full_ids[start:end], start, full_text[start:end]))
        received = end
    chunk = s.take()
    assert chunk.ids == full_ids[:received] and chunk.text == full_text[:received]


def test_a_delta_past_what_is_held_waits_for_the_resync():
    """A lost message (a gap) must not be spliced over: the delta after it is dropped whole, finish
    included, and the resync from offset 0 fills everything in (issue #31)."""
    s = state()
    s.apply(delta(0, [1, 2], 0, "ab"))
    assert s.apply(delta(3, [4], 3, "d")) == 0  # ids 2 and text 2 were lost: a gap in both
    assert s.apply(delta(4, [5], 4, "e", finish=True)) == 0 and not s.finished
    assert s.gaps == 2 and s.num_ids == 2 and s.num_chars == 2
    assert s.apply(delta(0, [1, 2, 3, 4, 5], 0, "abcde", finish=True)) == 3  # the resync
    chunk = s.take()
    assert s.finished and chunk.ids == [1, 2, 3, 4, 5] and chunk.text == "abcde"


def test_a_text_gap_alone_is_a_gap():
    s = state()
    s.apply(delta(0, [1], 0, "a"))
    assert s.apply(delta(1, [2], 2, "c")) == 0  # ids contiguous, but text 1 was lost
    assert s.take().text == "a" and s.gaps == 1
