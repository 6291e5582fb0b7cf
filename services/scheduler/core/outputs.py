"""What a request emits: its new output as a TokenDelta (the ring's message), and its whole result
for in-process callers.

Streaming requests emit the ids sampled since their last emission; non-streaming ones emit once, at
finish, with all ids. The first emission of a request (and every full, resync emission) carries its
DecodeParams, which is what the detokenizer needs to know about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.message import DecodeParams, Finish, Logprob, TokenDelta
from services.scheduler.core import prompt_logprobs
from services.scheduler.core.req import PromptLogprob, Req, TopLogprobs


@dataclass
class GenerationResult:
    """All of one request's output (what `Engine.generate` returns)."""

    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    input_logprobs: list[PromptLogprob] = field(default_factory=list)
    finish: Finish | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0

    @classmethod
    def of(cls, req: Req) -> GenerationResult:
        return cls(rid=req.rid, output_ids=list(req.output_ids), logprobs=list(req.output_logprobs),
                   top_logprobs=list(req.output_top_logprobs) if req.top_logprobs_num else [],
                   input_logprobs=list(req.input_logprobs),
                   finish=req.finished_reason, cached_tokens=req.cached_tokens, prompt_tokens=req.prompt_tokens)


def make_output(req: Req, full: bool = False) -> TokenDelta:
    """The req's new output since its last emission (or all of it when full), and mark it sent."""
    start = 0 if full else req.sent_offset
    out = TokenDelta(rid=req.rid, offset=start, ids=req.output_ids[start:], finish=req.finished_reason,
                     cached_tokens=req.cached_tokens)
    if req.return_logprob:
        tops = req.output_top_logprobs[start:] if req.top_logprobs_num else [None] * (len(req.output_ids) - start)
        out.logprobs = [Logprob(t, 0.0 if lp is None else lp, tuple(top or ()))
                        for t, lp, top in zip(out.ids, req.output_logprobs[start:], tops, strict=True)]
    if req.logprob_start_len >= 0 and not prompt_logprobs.wants(req) and (full or not req.input_logprobs_sent):
        out.input_logprobs = [Logprob(t, lp, tuple(top or ())) for t, lp, top in req.input_logprobs]
        req.input_logprobs_sent = True
    if full or not req.params_sent:
        out.params = DecodeParams(owner=req.owner, sampling=req.params, stream=req.stream,
                                  prompt_tokens=req.prompt_tokens)
        req.params_sent = True
        out.weight_version = req.weight_version
    if req.finished_reason is not None:
        out.timings = req.timings.measured()
        out.weight_version = req.weight_version
    req.sent_offset = len(req.output_ids)
    return out
