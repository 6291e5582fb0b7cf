"""OpenAI-compatible request and response models (what /openapi.json documents).

Known fields are typed, so a wrong type is a 400 naming the field. The SGLang/vLLM extras that
benchmark clients send (ignore_eos, top_k, min_p, ...) are accepted as in those servers. A field
that OpenAI, SGLang or vLLM define and that would change the output, but that this server does not
implement, is a 400 naming it (UNSUPPORTED_FIELDS); a field no API defines is ignored and logged
once per name, as vLLM does (clients and benchmarks send many).
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import GatewayError

log = logging.getLogger(__name__)

# The widths of the protobuf fields these values go into: an out-of-range number must be a 400
# naming the field here, not a ValueError (500) when the GenerateRequest is built.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]

Prompt = str | list[str] | list[Int32] | list[list[Int32]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Fields of the OpenAI, SGLang or vLLM APIs that change the output and are not implemented here,
# with the values that ask for nothing (sent by clients that fill every field): any other value is
# a 400 naming the field, never a silent 200. A request model that declares one of them (lora_path on
# the generation requests) implements it; the others still refuse it.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "functions": (None, []), "function_call": (None, "none"), "verbosity": (None,),
    # SGLang
    "lora_path": (None, ""), "priority": (None, 0), "return_hidden_states": (None, False),
    "session_params": (None,), "custom_logit_processor": (None, ""), "custom_params": (None,),
    "image_data": (None, []), "audio_data": (None, []), "video_data": (None, []),
    "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,),
    "stream_reasoning": (None, True), "return_routed_experts": (None, False),
    # vLLM
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "documents": (None,), "mm_processor_kwargs": (None,),
    "return_tokens_as_token_ids": (None, False), "kv_transfer_params": (None,), "vllm_xargs": (None,),
    "echo_chat": (None,),
}
_HINTS = {"guided_json": "response_format or json_schema", "guided_regex": "regex",
          "guided_choice": "regex", "guided_grammar": "ebnf", "structured_outputs": "response_format, "
          "json_schema, regex or ebnf", "functions": "tools", "function_call": "tool_choice"}
_logged_unknown: set[str] = set()


class ApiRequest(_Request):
    """A route's whole body: keeps the fields it does not declare, so that check_fields can refuse
    the unsupported ones and log the unknown ones."""

    model_config = ConfigDict(extra="allow")

    def check_fields(self) -> None:
        for name, value in (self.model_extra or {}).items():
            neutral = UNSUPPORTED_FIELDS.get(name)
            if neutral is None:
                if name not in _logged_unknown and len(_logged_unknown) < 1024:  # bounded: names are the client's
                    _logged_unknown.add(name)
                    log.warning("ignoring unknown request field %r (logged once)", name)
                continue
            if any(value == v for v in neutral):
                continue
            hint = f"; use {_HINTS[name]}" if name in _HINTS else ""
            raise GatewayError(400, f"{name}: not supported by this server{hint}", param=name)


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """response_format.json_schema. `strict` is accepted and ignored: the schema is always enforced
    strictly (no properties or items the schema does not name)."""

    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema (an object).")
    strict: bool | None = None


class ResponseFormat(_Request):
    """text: no constraint; json_object: any JSON object; json_schema: JSON valid for json_schema.schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(ApiRequest):
    """SGLang's sampling parameters under their protobuf names, shared by the OpenAI and the native
    requests.

    convert.sampling_pb copies each field of a request that common.SamplingParams has, by name, so a
    new sampling field is declared here once (besides the proto). max_new_tokens / min_new_tokens are
    not here: OpenAI calls them max_tokens / min_tokens, so each request model declares its own.
    Ranges are the tokenizer's to check (its error names the field); a request model tightens one
    only where its API documents it."""

    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool = False
    n: int | None = Field(None, ge=1, le=2**32 - 1)
    seed: Int64 | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # OpenAI's shape: token ids as JSON object keys (strings); convert.sampling_pb makes them ints.
    logit_bias: dict[str, float] | None = None
    stop_regex: str | list[str] | None = None


class SamplingExtras(SamplingFields):
    """Fields shared by completions and chat: OpenAI's sampling knobs plus SGLang/vLLM extras
    (the SGLang names come from SamplingFields)."""

    model: str | None = Field(None, description="Served model name; must match /v1/models when set.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's defaults and documented ranges, checked here as OpenAI does.
    n: int = Field(1, ge=1, le=128)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    response_format: ResponseFormat | None = None
    min_tokens: UInt32 = 0  # vLLM's name for min_new_tokens
    rid: str | None = Field(None, description="Request id (SGLang extra); generated when absent.")
    lora_path: str | None = Field(None, description="A loaded LoRA adapter's name (SGLang extra); "
                                                     "or name the adapter as the model (vLLM).")


class CompletionRequest(SamplingExtras):
    prompt: Prompt = Field(..., description="Text, list of texts, token ids or list of token-id lists.")
    max_tokens: UInt32 | None = 16
    logprobs: int | None = Field(None, ge=0, le=20, description="Return this many top logprobs per token.")
    echo: bool = False
    best_of: int | None = Field(None, description="Only 1 is supported.")
    suffix: str | None = None


class TextPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str = Field("", description="The arguments as JSON text.")


class ToolCallIn(_Request):
    """A call in an assistant message of the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Request):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema object.")
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatFields(ApiRequest):
    """A conversation and how the chat template renders it (chat completions, /tokenize)."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default "auto" with tools, else "none". "required" and a named function '
                          "constrain decoding to a valid call.")
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='More chat template variables, e.g. {"enable_thinking": false}.')
    reasoning_effort: str | None = Field(None, description="Passed to the chat template (as vLLM does).")
    separate_reasoning: bool = Field(True, description="With a reasoning parser: thinking in reasoning_content.")


class ChatCompletionRequest(SamplingExtras, ChatFields):
    max_tokens: UInt32 | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: UInt32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TokenizeRequest(ChatFields):
    """POST /tokenize (SGLang's and vLLM's): a prompt, a list of prompts, or chat messages."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None  # type: ignore[assignment]  # optional here
    add_special_tokens: bool = Field(True, description="Add BOS to a prompt (chat templates carry their own).")
    return_token_strs: bool = Field(False, description="Also return each token's text (vLLM's token_strs).")


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int
    token_strs: list[str] | list[list[str]] | None = None


class DetokenizeRequest(ApiRequest):
    """POST /detokenize (SGLang's and vLLM's)."""

    model: str | None = None
    tokens: list[Int32] | list[list[Int32]]
    skip_special_tokens: bool = True


class DetokenizeResponse(BaseModel):
    text: str | list[str] = Field(..., description="The text (SGLang's name).")
    prompt: str | list[str] = Field(..., description="The same text (vLLM's name).")


# ---- responses ----

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ringserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for the base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
