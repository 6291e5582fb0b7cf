"""Prompt logprobs pass through the detokenizer: with the streamed delta that carried them, and held
for a non-streaming request's single delta at finish."""

from __future__ import annotations

from ringserve.message import DecodeParams, Finish, Logprob, StepBatch, TokenDelta
from ringserve.text_tokenizer import TextTokenizer
from services.detokenizer.detokenizer import Detokenizer

# Passed through as they came: the detokenizer never reads them.
PROMPT_LPS = [Logprob(token_id=0, logprob=-0.5), Logprob(token_id=1, logprob=-1.5, top=((2, -0.25),))]


def _run(tok: TextTokenizer, stream: bool) -> list:
    det = Detokenizer(tok)
    ids = tok.encode("hello there world", add_special_tokens=False)
    params = DecodeParams(owner="o", stream=stream)
    first = TokenDelta(rid="r", ids=ids[:1], offset=0, params=params, input_logprobs=PROMPT_LPS)
    last = TokenDelta(rid="r", ids=ids[1:], offset=1, finish=Finish(type="length"))
    out = []
    for d in (first, last):
        batches, _ = det.step(StepBatch([d]))
        out += [t for b in batches for t in b.deltas]
    return out


def test_streamed_with_the_first_delta(tiny_tok: TextTokenizer) -> None:
    first, last = _run(tiny_tok, stream=True)
    assert first.input_logprobs == PROMPT_LPS and last.input_logprobs == []


def test_held_for_a_non_streaming_request(tiny_tok: TextTokenizer) -> None:
    (only,) = _run(tiny_tok, stream=False)
    assert only.input_logprobs == PROMPT_LPS and only.finish is not None
