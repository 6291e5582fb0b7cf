"""Log probability of one token and the most likely alternatives at its position."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from ringserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first
    token: str = ""                           # texts: filled by the tokenizer service only
    top_tokens: tuple[str, ...] = ()

    # The conversions run once per token of every request that asks for logprobs (from_pb in the
    # detokenizer and the tokenizer, add_to in the scheduler and the detokenizer), so they are written
    # for speed: one pass over the alternatives, messages added in place rather than built and copied.

    def add_to(self, out: RepeatedCompositeFieldContainer[common_pb2.TokenLogprob]) -> None:
        """Append to a repeated TokenLogprob field, in place."""
        self._add_top(out.add(token_id=self.token_id, logprob=self.logprob, token=self.token))

    def to_pb(self) -> common_pb2.TokenLogprob:
        pb = common_pb2.TokenLogprob(token_id=self.token_id, logprob=self.logprob, token=self.token)
        self._add_top(pb)
        return pb

    def _add_top(self, pb: common_pb2.TokenLogprob) -> None:
        add = pb.top_logprobs.add
        if self.top_tokens:
            for (t, p), name in zip(self.top, self.top_tokens, strict=True):
                add(token_id=t, logprob=p, token=name)
        else:
            for t, p in self.top:
                add(token_id=t, logprob=p)

    @classmethod
    def from_pb(cls, pb: common_pb2.TokenLogprob) -> Logprob:
        tops = pb.top_logprobs
        if not tops:  # logprobs asked for without alternatives
            return cls(pb.token_id, pb.logprob, (), pb.token)
        top: list[tuple[int, float]] = []
        names: list[str] = []
        for t in tops:
            top.append((t.token_id, t.logprob))
            names.append(t.token)
        return cls(pb.token_id, pb.logprob, tuple(top), pb.token, tuple(names) if any(names) else ())

    @staticmethod
    def list_to_pb(lps: Iterable[Logprob]) -> list[common_pb2.TokenLogprob]:
        return [lp.to_pb() for lp in lps]

    @classmethod
    def list_from_pb(cls, pbs: Iterable[common_pb2.TokenLogprob]) -> list[Logprob]:
        return [cls.from_pb(pb) for pb in pbs]
