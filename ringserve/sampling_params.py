"""Resolved sampling parameters: what the tokenizer validates and the scheduler samples with.

The proto's `SamplingParams` leaves fields unset to mean "the default"; this is the plain mirror
with every default filled in, converted at both edges of the tokenizer -> scheduler hop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringserve.v1 import common_pb2

CONSTRAINTS = ("json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                   # -1: all tokens
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = None
    no_stop_trim: bool = False
    # At most one constraint (the tokenizer checks); the grammar queue compiles it, the mask enforces it.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> SamplingParams:
        """An unset optional field takes the default; top_k 0 means all tokens, as in vLLM."""
        d = cls()

        def opt(name: str, default: Any) -> Any:
            return getattr(pb, name) if pb.HasField(name) else default

        top_k = int(opt("top_k", d.top_k))
        return cls(
            temperature=float(opt("temperature", d.temperature)), top_p=float(opt("top_p", d.top_p)),
            top_k=-1 if top_k == 0 else top_k, min_p=float(pb.min_p),
            frequency_penalty=float(pb.frequency_penalty), presence_penalty=float(pb.presence_penalty),
            repetition_penalty=float(opt("repetition_penalty", d.repetition_penalty)),
            max_new_tokens=int(opt("max_new_tokens", d.max_new_tokens)), min_new_tokens=int(pb.min_new_tokens),
            stop=tuple(pb.stop), stop_token_ids=tuple(pb.stop_token_ids), ignore_eos=bool(pb.ignore_eos),
            skip_special_tokens=bool(opt("skip_special_tokens", d.skip_special_tokens)),
            spaces_between_special_tokens=bool(opt("spaces_between_special_tokens",
                                                   d.spaces_between_special_tokens)),
            seed=int(pb.seed) if pb.HasField("seed") else None, no_stop_trim=bool(pb.no_stop_trim),
            **{name: opt(name, None) for name in CONSTRAINTS})

    def to_pb(self) -> common_pb2.SamplingParams:
        """Every field explicit (n is already expanded by the tokenizer, so it is 1)."""
        pb = common_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, n=1,
            no_stop_trim=self.no_stop_trim)
        if self.seed is not None:
            pb.seed = self.seed
        for name in CONSTRAINTS:  # proto3 optional: set only the one given
            if getattr(self, name) is not None:
                setattr(pb, name, getattr(self, name))
        return pb
