"""Range checks of one request's SamplingParams that need no prompt: the tokenizer's intake and the
scheduler's SGLang-protocol port (services/scheduler/rpc/sglang_convert.py) both run them, so a bad
value is refused the same way, naming the same field, whichever front end sent it.

Every problem raises InvalidArgument whose message starts with the field's name
(`sampling_params.top_p: ...`).
"""

from __future__ import annotations

import json
import math
from typing import Protocol

from ringserve.errors import InvalidArgument
from ringserve.message.sampling import CONSTRAINTS, SamplingParams
from ringserve.stop_regex import problem as stop_regex_problem


class SamplingLimits(Protocol):
    """The configured bounds the checks need (the tokenizer's Limits has them)."""

    @property
    def max_n(self) -> int: ...
    @property
    def max_stop_strings(self) -> int: ...
    @property
    def max_stop_len(self) -> int: ...


def _sp(name: str) -> str:
    return f"sampling_params.{name}"


def _finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))


def check_sampling(sp: SamplingParams, vocab_size: int, limits: SamplingLimits) -> None:
    """Range checks that need no prompt. `not (a <= x <= b)` also rejects NaN."""
    if not (sp.temperature >= 0 and _finite(sp.temperature)):
        raise InvalidArgument(_sp("temperature"), f"must be >= 0, got {sp.temperature}")
    if not (0 < sp.top_p <= 1):
        raise InvalidArgument(_sp("top_p"), f"must be in (0, 1], got {sp.top_p}")
    if sp.top_k < -1:
        raise InvalidArgument(_sp("top_k"), f"must be -1 or 0 (all tokens) or >= 1, got {sp.top_k}")
    if not (0 <= sp.min_p <= 1):
        raise InvalidArgument(_sp("min_p"), f"must be in [0, 1], got {sp.min_p}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(sp, name)
        if not (-2 <= value <= 2):
            raise InvalidArgument(_sp(name), f"must be in [-2, 2], got {value}")
    if not (0 < sp.repetition_penalty <= 2):
        raise InvalidArgument(_sp("repetition_penalty"), f"must be in (0, 2], got {sp.repetition_penalty}")
    if sp.max_new_tokens is not None and sp.min_new_tokens > sp.max_new_tokens:
        raise InvalidArgument(_sp("min_new_tokens"),
                              f"{sp.min_new_tokens} is more than max_new_tokens ({sp.max_new_tokens})")
    if not (1 <= sp.n <= limits.max_n):
        raise InvalidArgument(_sp("n"), f"must be in [1, {limits.max_n}], got {sp.n}")
    if len(sp.stop) > limits.max_stop_strings:
        raise InvalidArgument(_sp("stop"), f"at most {limits.max_stop_strings} stop strings, got {len(sp.stop)}")
    for i, s in enumerate(sp.stop):
        if not s:
            raise InvalidArgument(_sp(f"stop[{i}]"), "must not be empty")
        if len(s) > limits.max_stop_len:
            raise InvalidArgument(_sp(f"stop[{i}]"), f"longer than {limits.max_stop_len} characters")
    if len(sp.stop_regex) > limits.max_stop_strings:
        raise InvalidArgument(_sp("stop_regex"),
                              f"at most {limits.max_stop_strings} patterns, got {len(sp.stop_regex)}")
    for i, pattern in enumerate(sp.stop_regex):
        if len(pattern) > limits.max_stop_len:
            raise InvalidArgument(_sp(f"stop_regex[{i}]"), f"longer than {limits.max_stop_len} characters")
        why = stop_regex_problem(pattern)
        if why is not None:
            raise InvalidArgument(_sp(f"stop_regex[{i}]"), why)
    # OpenAI's range. The keys are checked against the vocabulary: the sampler indexes the logits by them.
    for token, bias in sp.logit_bias:
        if not (0 <= token < vocab_size):
            raise InvalidArgument(_sp("logit_bias"), f"token id {token} is outside [0, {vocab_size})")
        if not (-100 <= bias <= 100):
            raise InvalidArgument(_sp("logit_bias"), f"bias of token {token} must be in [-100, 100], got {bias}")
    for i, t in enumerate(sp.stop_token_ids):
        if not (0 <= t < vocab_size):
            raise InvalidArgument(_sp(f"stop_token_ids[{i}]"), f"{t} is outside [0, {vocab_size})")
    constrained = [f for f in CONSTRAINTS if getattr(sp, f) is not None]
    if len(constrained) > 1:
        raise InvalidArgument(_sp(constrained[0]),
                              f"at most one of json_schema, regex, ebnf (got {', '.join(constrained)})")
    # Only the cheap check here: compiling (and every other schema / pattern / grammar error) is the
    # scheduler's, whose INVALID_ARGUMENT abort names the same field.
    if sp.json_schema is not None:
        try:
            json.loads(sp.json_schema)
        except ValueError as e:
            raise InvalidArgument(_sp("json_schema"), f"not valid JSON: {e}") from None
