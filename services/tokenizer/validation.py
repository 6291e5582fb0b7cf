"""Check a GenerateInput before anything reaches a scheduler, and resolve its max_new_tokens.

Every problem raises InvalidArgument whose message starts with the field's name
(`sampling_params.top_p: ...`), so the gateway can turn it into a 400 that names the field.
Nothing here knows gRPC; the model facts come from a TextTokenizer-like object. The defaults
themselves are SamplingParams' (unset fields already hold them); only max_new_tokens waits for the
prompt, and `SamplingParams.resolve` gives each sample its final parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ringserve.errors import InvalidArgument, NotFound
from ringserve.message import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from ringserve.message.sampling import CONSTRAINTS
from ringserve.sampling_checks import check_sampling
from ringserve.text_tokenizer import ChatTemplateError

from .io_struct import GenerateInput
from .parsers.forced_calls import forced_call_schema


class ModelTokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...
    context_length: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]: ...


@dataclass(frozen=True)
class Limits:
    served_model_name: str
    max_n: int = 16
    max_stop_strings: int = 16        # stop strings, and separately stop_regex patterns
    max_stop_len: int = 256           # characters of a stop string or a stop_regex pattern
    max_top_logprobs: int = 20


@dataclass(frozen=True)
class Prepared:
    """A checked request: the prompt ids and the resolved SamplingParams of each sample (n of them)."""

    input_ids: list[int]
    samplings: list[SamplingParams]


def _sp(name: str) -> str:
    return f"sampling_params.{name}"


def _input_field(req: GenerateInput) -> str:
    if req.chat is not None:
        return "chat"
    return "input_ids" if req.input_ids is not None else "text"


def tokenize_input(req: GenerateInput, tok: ModelTokenizer) -> list[int]:
    """The prompt ids; empty input and chat template errors are INVALID_ARGUMENT."""
    if req.chat is not None:
        if not req.chat.messages:
            raise InvalidArgument("chat.messages", "must not be empty")
        try:
            ids = tok.encode_chat(req.chat.messages, req.chat.add_generation_prompt,
                                  req.chat.continue_final_message, req.chat.template_tools,
                                  req.chat.template_kwargs)
        except ChatTemplateError as e:
            raise InvalidArgument("chat", str(e)) from e
        if not ids:
            raise InvalidArgument("chat", "the chat template rendered an empty prompt")
        return ids
    if req.input_ids is not None:
        if not req.input_ids:
            raise InvalidArgument("input_ids", "must not be empty")
        vocab = tok.vocab_size  # asked once: on a real tokenizer it is a call into the library
        if not (0 <= min(req.input_ids) and max(req.input_ids) < vocab):
            i, t = next((i, t) for i, t in enumerate(req.input_ids) if not 0 <= t < vocab)
            raise InvalidArgument("input_ids", f"id {t} at position {i} is outside [0, {vocab})")
        return list(req.input_ids)
    if req.text is None:
        raise InvalidArgument("input", "one of text, input_ids or chat is required")
    if not req.text:
        raise InvalidArgument("text", "must not be empty")
    return tok.encode(req.text)


def resolve_max_new_tokens(sp: SamplingParams, prompt_len: int, context_length: int, input_field: str) -> int:
    """An explicit max_new_tokens must fit the context; an unset one is capped to the room left."""
    room = context_length - prompt_len
    if room <= 0:
        raise InvalidArgument(input_field,
                              f"the prompt has {prompt_len} tokens; the context length is {context_length}")
    if sp.max_new_tokens is None:
        mnt = min(DEFAULT_MAX_NEW_TOKENS, room)
    elif sp.max_new_tokens > room:
        raise InvalidArgument(_sp("max_new_tokens"),
                              f"prompt ({prompt_len}) + max_new_tokens ({sp.max_new_tokens}) is more than "
                              f"the context length ({context_length})")
    else:
        mnt = sp.max_new_tokens
    if sp.min_new_tokens > mnt:
        raise InvalidArgument(_sp("min_new_tokens"), f"{sp.min_new_tokens} is more than max_new_tokens ({mnt})")
    return mnt


def check_request(req: GenerateInput, tok: ModelTokenizer, limits: Limits) -> None:
    """Checks that need no tokenization (cheap; run before the template renders)."""
    if req.model and req.model != limits.served_model_name:
        raise NotFound(f"model: '{req.model}' is not served here (this server serves "
                       f"'{limits.served_model_name}')")
    check_sampling(req.sampling, tok.vocab_size, limits)
    if req.top_logprobs_num > limits.max_top_logprobs:
        raise InvalidArgument("top_logprobs_num", f"must be at most {limits.max_top_logprobs}, "
                              f"got {req.top_logprobs_num}")
    if req.logprob_start_len < -1:
        raise InvalidArgument("logprob_start_len",
                              f"must be -1 (none) or a prompt position, got {req.logprob_start_len}")


def tool_constraint(req: GenerateInput) -> SamplingParams:
    """The request's sampling, constrained to a valid call when its tool_choice forces one."""
    chat, sp = req.chat, req.sampling
    if chat is None or chat.tool_choice not in ("required", "function"):
        return sp
    other = [n for n in CONSTRAINTS if getattr(sp, n) is not None]
    if other:
        raise InvalidArgument("chat.tool_choice", f"{chat.tool_choice!r} cannot be combined with "
                              f"{_sp(other[0])} (both constrain the output)")
    schema = forced_call_schema(chat.template_tools or [], chat.tool_name if chat.tool_choice == "function" else None,
                                chat.parallel_tool_calls)
    return replace(sp, json_schema=schema)


def prepare(req: GenerateInput, tok: ModelTokenizer, limits: Limits) -> Prepared:
    """Validate, tokenize and expand n: sample i gets seed + i when a seed was given."""
    check_request(req, tok, limits)
    ids = tokenize_input(req, tok)
    sp = tool_constraint(req)
    mnt = resolve_max_new_tokens(sp, len(ids), tok.context_length, _input_field(req))
    return Prepared(input_ids=ids, samplings=[sp.resolve(mnt, i) for i in range(sp.n)])
