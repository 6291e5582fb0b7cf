"""Plain dataclasses the tokenizer core works with; the servicer and the clients convert protobuf at the edge.

Named after SGLang's io_struct: what comes in (GenerateInput), what goes to a scheduler
(TokenizedReq), what comes back from the detokenizer (TextDeltaIn) and what goes out (GenerateOutput).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.finish import Finish  # noqa: F401 - part of this module's vocabulary
from ringserve.sampling_params import SamplingParams as Sampling  # noqa: F401 - validated, defaults resolved


@dataclass(frozen=True)
class ChatInput:
    messages: list[dict[str, str]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(frozen=True)
class SamplingInput:
    """Sampling parameters as the client sent them; None means "unset, take the default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    seed: int | None = None
    n: int | None = None
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


@dataclass(frozen=True)
class GenerateInput:
    """One Generate call. Exactly one of text / input_ids / chat should be set (validation checks)."""

    rid: str = ""
    text: str | None = None
    input_ids: list[int] | None = None
    chat: ChatInput | None = None
    sampling: SamplingInput = field(default_factory=SamplingInput)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_timings: bool = False
    model: str = ""
    logprob_start_len: int = -1  # with return_logprob: score the prompt from here (-1: no)


@dataclass(frozen=True)
class TokenizedReq:
    """One internal request (one sample) as sent to a scheduler."""

    rid: str
    owner: str
    input_ids: list[int]
    sampling: Sampling
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int = -1


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    token: str = ""
    top_tokens: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextDeltaIn:
    """A TextDelta from the detokenizer."""

    rid: str
    token_offset: int
    ids: list[int]
    text_offset: int
    text: str
    logprobs: list[Logprob] = field(default_factory=list)
    finish: Finish | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    timings: dict[str, float] | None = None
    input_logprobs: list[Logprob] = field(default_factory=list)


@dataclass
class GenerateOutput:
    """One message of a Generate stream."""

    rid: str
    index: int
    text: str
    output_ids: list[int]
    logprobs: list[Logprob]
    finished: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_logprobs: list[Logprob] = field(default_factory=list)  # the prompt's, on the first output
    finish: Finish | None = None
    e2e_latency: float = 0.0
    timings: dict[str, float] | None = None


@dataclass(frozen=True)
class LoadInfo:
    """A scheduler's last LoadReport, as the tokenizer knows it."""

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_used_tokens: int = 0
    max_total_num_tokens: int = 0
    token_usage: float = 0.0

    @property
    def num_reqs(self) -> int:
        return self.num_running_reqs + self.num_queue_reqs
