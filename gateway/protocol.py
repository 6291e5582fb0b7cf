"""OpenAI-compatible request and response models (what /openapi.json documents).

Requests ignore unknown fields (clients and benchmarks send many); known fields are typed, so a
wrong type is a 400 naming the field. The SGLang/vLLM extras that benchmark clients send
(ignore_eos, top_k, min_p, ...) are accepted as in those servers.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The widths of the protobuf fields these values go into: an out-of-range number must be a 400
# naming the field here, not a ValueError (500) when the GenerateRequest is built.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
UInt32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]

Prompt = str | list[str] | list[Int32] | list[list[Int32]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


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


class SamplingFields(_Request):
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


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: UInt32 | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: UInt32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
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
