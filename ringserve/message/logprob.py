"""Log probability of one token and the most likely alternatives at its position."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ringserve.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class Logprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first
    token: str = ""                           # texts: filled by the tokenizer service only
    top_tokens: tuple[str, ...] = ()

    def to_pb(self) -> common_pb2.TokenLogprob:
        names = self.top_tokens or ("",) * len(self.top)
        return common_pb2.TokenLogprob(
            token_id=self.token_id, logprob=self.logprob, token=self.token,
            top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=p, token=name)
                          for (t, p), name in zip(self.top, names, strict=True)])

    @classmethod
    def from_pb(cls, pb: common_pb2.TokenLogprob) -> Logprob:
        return cls(token_id=pb.token_id, logprob=pb.logprob, token=pb.token,
                   top=tuple((t.token_id, t.logprob) for t in pb.top_logprobs),
                   top_tokens=tuple(t.token for t in pb.top_logprobs) if any(t.token for t in pb.top_logprobs)
                   else ())

    @staticmethod
    def list_to_pb(lps: Iterable[Logprob]) -> list[common_pb2.TokenLogprob]:
        return [lp.to_pb() for lp in lps]

    @classmethod
    def list_from_pb(cls, pbs: Iterable[common_pb2.TokenLogprob]) -> list[Logprob]:
        return [cls.from_pb(pb) for pb in pbs]
