"""How to sample one request: the client's parameters, resolved once at intake.

The proto leaves a field unset to mean "the default"; `from_pb` fills in the defaults written here,
and nowhere else. One field stays open until intake: `max_new_tokens` is None when the client did not
set it, and `resolve` (in the tokenizer, which knows the prompt and the context length) fixes it. Every
hop after the tokenizer sees a resolved value.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ringserve.message.codec import fields_from_pb, fields_to_pb
from ringserve.v1 import common_pb2

CONSTRAINTS = ("json_schema", "regex", "ebnf")
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                   # -1: all tokens (0, as OpenAI-style clients say it, becomes -1)
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None  # None until intake resolves it (see resolve)
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = None
    n: int = 1                         # samples of the prompt; the tokenizer expands them
    no_stop_trim: bool = False
    # At most one constraint (the tokenizer checks); the grammar queue compiles it, the mask enforces it.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # (token id, bias) sorted by id: added to the logits before sampling (sampling.py builds one sparse
    # tensor of a batch's biases). A tuple, not a dict: the dataclass is frozen and compared.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Stop patterns (Python `re`); the scheduler searches the output's tail (ringserve/stop_regex.py).
    stop_regex: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)  # the one spelling of "all tokens" past here

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def argmax_of_logits(self) -> bool:
        """The next token is the argmax of the model's raw logits: greedy, and no penalty or logit_bias
        edits them first (min_new_tokens, which depends on the output so far, aside)."""
        return self.is_greedy and not self.has_penalties and not self.logit_bias

    @property
    def max_tokens(self) -> int:
        """max_new_tokens as the scheduler applies it. Intake always resolves it; only an in-process
        caller that never went through a tokenizer leaves it unset and gets the default."""
        return DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens

    def resolve(self, max_new_tokens: int, sample: int = 0) -> SamplingParams:
        """The parameters of sample `sample` of this request as the scheduler gets them: max_new_tokens
        fixed, n expanded (each sample gets seed + sample when seeded)."""
        return replace(self, max_new_tokens=max_new_tokens, n=1, seed=None if self.seed is None else self.seed + sample)

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> SamplingParams:
        return fields_from_pb(cls, pb)

    def to_pb(self) -> common_pb2.SamplingParams:
        return fields_to_pb(self, common_pb2.SamplingParams)
