"""The servicer's edge: what the core does not read (logprobs, a finish's status, the scheduler's
timings) leaves on the wire as it came, with the detokenizer's own timing added at finish."""

from __future__ import annotations

import grpc

from ringserve.message import DecodeParams, Finish, SamplingParams
from ringserve.text_tokenizer import TextTokenizer
from ringserve.v1 import common_pb2
from ringserve.v1 import detokenizer_pb2 as pb
from services.detokenizer.config import DetokenizerConfig
from services.detokenizer.server import build_servicer


def logprob(token_id: int) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, top_logprobs=[
        common_pb2.TopLogprob(token_id=token_id + 1, logprob=-1.0), common_pb2.TopLogprob(token_id=3, logprob=-2.0)])


async def test_logprobs_status_and_timings_pass_through(tiny_tok: TextTokenizer) -> None:
    servicer = build_servicer(DetokenizerConfig(model="unused", metrics_port=-1), tiny_tok)
    sub = servicer.subs.subscribe("o")
    ids = tiny_tok.encode("hello there", add_special_tokens=False)
    lps = [logprob(i) for i in ids]
    prompt_lps = [common_pb2.TokenLogprob(token_id=7, logprob=-3.0)]
    params = DecodeParams(owner="o", sampling=SamplingParams(max_new_tokens=16), prompt_tokens=4)
    finish = Finish.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory")
    await servicer.handle_batch(pb.StepBatch(sent_at=1.5, deltas=[pb.TokenDelta(
        rid="r", offset=0, ids=ids[:1], params=params.to_pb(), logprobs=lps[:1], input_logprobs=prompt_lps)]))
    await servicer.handle_batch(pb.StepBatch(deltas=[pb.TokenDelta(
        rid="r", offset=1, ids=ids[1:], logprobs=lps[1:], cached_tokens=2, finish=finish.to_pb(),
        timings=common_pb2.Timings(queue_s=0.25, decode_s=0.5))]))
    first, last = await sub.get(), await sub.get()
    assert first is not None and last is not None and first.step_sent_at == 1.5
    (a,), (b,) = first.deltas, last.deltas
    assert a.text + b.text == "hello there" and a.prompt_tokens == 4 and b.cached_tokens == 2
    assert list(a.logprobs) == lps[:1] and list(b.logprobs) == lps[1:]
    assert list(a.input_logprobs) == prompt_lps and not b.input_logprobs
    assert not a.HasField("timings") and not a.HasField("finish")
    assert Finish.from_pb(b.finish) == finish
    assert b.timings.queue_s == 0.25 and b.timings.decode_s == 0.5 and b.timings.detokenize_s > 0
    servicer.close()
