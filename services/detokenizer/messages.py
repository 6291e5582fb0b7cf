"""What the detokenizer core takes in and gives out: plain dataclasses, converted at the servicer.

Logprobs and scheduler timings are carried through untouched (the core never reads them), so they
stay opaque here and the servicer copies them back onto the wire messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringserve.finish import Finish  # noqa: F401 - part of this module's vocabulary

FINISH_ABORT = "abort"


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """Per-request decode settings, sent on a request's first delta and on every resync."""

    owner: str
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    # Fast (Rust) tokenizers ignore this, as transformers' and vLLM's fast paths do; carried for the API.
    spaces_between_special_tokens: bool = True
    stream: bool = True
    prompt_tokens: int = 0


@dataclass(slots=True)
class TokenDelta:
    """New output ids of one request in one scheduler step."""

    rid: str
    ids: list[int]
    offset: int = 0
    params: DecodeParams | None = None
    finish: Finish | None = None
    logprobs: list[Any] = field(default_factory=list)  # opaque, passed through
    cached_tokens: int = 0
    timings: Any = None  # opaque, passed through on the last delta
    input_logprobs: list[Any] = field(default_factory=list)  # opaque: the prompt's, once


@dataclass(slots=True)
class StepBatch:
    """Everything one scheduler step produced."""

    deltas: list[TokenDelta]
    sent_at: float = 0.0
    resync: bool = False


@dataclass(slots=True)
class TextDelta:
    """New text of one request, for its owner."""

    rid: str
    token_offset: int
    ids: list[int]
    text_offset: int
    text: str
    logprobs: list[Any] = field(default_factory=list)
    finish: Finish | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    timings: Any = None
    detokenize_s: float = 0.0  # decode work attributed to this request (set on the last delta)
    input_logprobs: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class OwnerBatch:
    """The text deltas of one step for one tokenizer replica (one SubscribeResponse)."""

    owner: str
    deltas: list[TextDelta]
    step_sent_at: float = 0.0
