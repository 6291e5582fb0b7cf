"""What the engine emits per step (plain dataclasses; the servicer turns them into TokenDeltas).

Streaming requests emit the ids sampled since their last emission; non-streaming ones emit once, at
finish, with all ids. The first emission of a request (and every resync emission) carries
`decode_params`, which is what the detokenizer needs to know about it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.core import prompt_logprobs
from services.scheduler.core.req import FinishInfo, Req


@dataclass
class DecodeParamsOut:
    owner: str
    stop: tuple[str, ...]
    no_stop_trim: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stream: bool
    prompt_tokens: int


@dataclass
class TimingsOut:
    to_scheduler_s: float
    queue_s: float
    prefill_s: float
    decode_s: float


@dataclass
class ReqOutput:
    rid: str
    owner: str
    offset: int                       # index in the output of ids[0]
    ids: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # The prompt's scored positions as (token id, logprob, top alternatives), once: with the first
    # token (and again in every full output).
    input_logprobs: list[tuple[int, float, list[tuple[int, float]] | None]] | None = None
    finish: FinishInfo | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0
    decode_params: DecodeParamsOut | None = None
    timings: TimingsOut | None = None


@dataclass
class GenerationResult:
    """All of one request's output (what `Engine.generate` returns)."""

    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    input_logprobs: list[tuple[int, float, list[tuple[int, float]] | None]] = field(default_factory=list)
    finish: FinishInfo | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0


def decode_params(req: Req) -> DecodeParamsOut:
    p = req.params
    return DecodeParamsOut(owner=req.owner, stop=tuple(p.stop), no_stop_trim=p.no_stop_trim,
                           skip_special_tokens=p.skip_special_tokens,
                           spaces_between_special_tokens=p.spaces_between_special_tokens,
                           stream=req.stream, prompt_tokens=req.prompt_tokens)


def make_output(req: Req, full: bool = False) -> ReqOutput:
    """The req's new output since its last emission (or all of it when full), and mark it sent."""
    start = 0 if full else req.sent_offset
    out = ReqOutput(rid=req.rid, owner=req.owner, offset=start, ids=req.output_ids[start:],
                    finish=req.finished_reason, cached_tokens=req.cached_tokens,
                    prompt_tokens=req.prompt_tokens)
    if req.return_logprob:
        out.logprobs = req.output_logprobs[start:]
        if req.top_logprobs_num:
            out.top_logprobs = req.output_top_logprobs[start:]
    if req.logprob_start_len >= 0 and not prompt_logprobs.wants(req) and (full or not req.input_logprobs_sent):
        out.input_logprobs = list(req.input_logprobs)
        req.input_logprobs_sent = True
    if full or not req.params_sent:
        out.decode_params = decode_params(req)
        req.params_sent = True
    if req.finished_reason is not None:
        t = req.timings
        out.timings = TimingsOut(to_scheduler_s=t.to_scheduler_s, queue_s=t.queue_s, prefill_s=t.prefill_s,
                                 decode_s=t.decode_s)
    req.sent_offset = len(req.output_ids)
    return out
