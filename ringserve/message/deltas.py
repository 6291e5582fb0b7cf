"""The per-step messages of the ring: token deltas (scheduler -> detokenizer) and text deltas
(detokenizer -> tokenizer).

These run once per request per scheduler step, so their conversions are written out by hand (repeated
scalar fields sliced, messages added in place), not through the generic codec.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.message.finish import Finish
from ringserve.message.logprob import Logprob
from ringserve.message.sampling import SamplingParams
from ringserve.message.timings import Timings
from ringserve.v1 import detokenizer_pb2


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """What the detokenizer needs to know about a request: sent with its first delta and on resync."""

    owner: str                       # the tokenizer replica the text goes to
    sampling: SamplingParams = field(default_factory=SamplingParams)  # stop strings, special tokens
    stream: bool = True              # a text delta every step; False: one delta at finish
    prompt_tokens: int = 0           # echoed to the tokenizer

    def to_pb(self) -> detokenizer_pb2.DecodeParams:
        return detokenizer_pb2.DecodeParams(owner=self.owner, sampling_params=self.sampling.to_pb(),
                                            stream=self.stream, prompt_tokens=self.prompt_tokens)

    @classmethod
    def from_pb(cls, pb: detokenizer_pb2.DecodeParams) -> DecodeParams:
        return cls(owner=pb.owner, sampling=SamplingParams.from_pb(pb.sampling_params), stream=pb.stream,
                   prompt_tokens=pb.prompt_tokens)


@dataclass(slots=True)
class TokenDelta:
    """New output ids of one request in one scheduler step."""

    rid: str
    ids: list[int]
    offset: int = 0                               # index in the request's output of ids[0]
    params: DecodeParams | None = None            # on the first delta and on every full (resync) delta
    finish: Finish | None = None                  # on the last delta
    logprobs: list[Logprob] = field(default_factory=list)        # of ids, when asked for
    cached_tokens: int = 0
    timings: Timings | None = None                # the scheduler's, on the last delta
    input_logprobs: list[Logprob] = field(default_factory=list)  # the prompt's, once
    weight_version: str = ""                      # with params and with finish

    def to_pb(self) -> detokenizer_pb2.TokenDelta:
        d = detokenizer_pb2.TokenDelta(rid=self.rid, offset=self.offset, ids=self.ids,
                                       cached_tokens=self.cached_tokens, weight_version=self.weight_version)
        if self.params is not None:
            d.params.CopyFrom(self.params.to_pb())
        for lp in self.logprobs:
            lp.add_to(d.logprobs)
        for lp in self.input_logprobs:
            lp.add_to(d.input_logprobs)
        if self.finish is not None:
            d.finish.CopyFrom(self.finish.to_pb())
        if self.timings is not None:
            d.timings.CopyFrom(self.timings.to_pb())
        return d

    @classmethod
    def from_pb(cls, d: detokenizer_pb2.TokenDelta) -> TokenDelta:
        # Hot path (once per request per step): slicing a repeated field is ~5x faster than list(), and
        # positional arguments (in field order) halve the constructor's cost against keywords.
        return cls(d.rid, d.ids[:], d.offset,
                   DecodeParams.from_pb(d.params) if d.HasField("params") else None,
                   Finish.from_pb(d.finish) if d.HasField("finish") else None,
                   Logprob.list_from_pb(d.logprobs) if len(d.logprobs) else [],
                   d.cached_tokens,
                   Timings.from_pb(d.timings) if d.HasField("timings") else None,
                   Logprob.list_from_pb(d.input_logprobs) if len(d.input_logprobs) else [],
                   d.weight_version)


@dataclass(slots=True)
class StepBatch:
    """Everything one scheduler step produced."""

    deltas: list[TokenDelta]
    sent_at: float = 0.0            # unix time the scheduler sent it
    resync: bool = False            # full state after a (re)connect: offset 0, params set

    def to_pb(self) -> detokenizer_pb2.StepBatch:
        return detokenizer_pb2.StepBatch(deltas=[d.to_pb() for d in self.deltas], sent_at=self.sent_at,
                                         resync=self.resync)

    @classmethod
    def from_pb(cls, b: detokenizer_pb2.StepBatch) -> StepBatch:
        return cls(deltas=[TokenDelta.from_pb(d) for d in b.deltas], sent_at=b.sent_at, resync=b.resync)


@dataclass(slots=True)
class TextDelta:
    """New text of one request, for its owner. Never ends in half a character; never holds text past
    a stop string."""

    rid: str
    token_offset: int                # index in the output ids of ids[0]
    ids: list[int]
    text_offset: int                 # index, in code points of the output text, where text starts
    text: str
    logprobs: list[Logprob] = field(default_factory=list)
    finish: Finish | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    timings: Timings | None = None   # scheduler's and detokenizer's, on the last delta
    input_logprobs: list[Logprob] = field(default_factory=list)
    weight_version: str = ""         # on the first and the last delta

    def add_to(self, resp: detokenizer_pb2.SubscribeResponse) -> None:
        """Append to `resp` (adding in place with keywords is the cheapest way to build it; the fields
        most deltas leave at their default are set only when they are not: ~0.1 us each per token)."""
        out = resp.deltas.add(rid=self.rid, token_offset=self.token_offset, ids=self.ids,
                              text_offset=self.text_offset, text=self.text, prompt_tokens=self.prompt_tokens)
        if self.cached_tokens:
            out.cached_tokens = self.cached_tokens
        if self.weight_version:
            out.weight_version = self.weight_version
        for lp in self.logprobs:
            lp.add_to(out.logprobs)
        for lp in self.input_logprobs:
            lp.add_to(out.input_logprobs)
        if self.finish is not None:
            out.finish.CopyFrom(self.finish.to_pb())
        if self.timings is not None:
            out.timings.CopyFrom(self.timings.to_pb())

    @classmethod
    def from_pb(cls, pb: detokenizer_pb2.TextDelta) -> TextDelta:
        # Hot path, as TokenDelta.from_pb: positional arguments in field order.
        return cls(pb.rid, pb.token_offset, pb.ids[:], pb.text_offset, pb.text,
                   Logprob.list_from_pb(pb.logprobs) if len(pb.logprobs) else [],
                   Finish.from_pb(pb.finish) if pb.HasField("finish") else None,
                   pb.prompt_tokens, pb.cached_tokens,
                   Timings.from_pb(pb.timings) if pb.HasField("timings") else None,
                   Logprob.list_from_pb(pb.input_logprobs) if len(pb.input_logprobs) else [],
                   pb.weight_version)
