"""SGLang-native request models (/generate, /abort_request), with SGLang's field names."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from gateway.protocol import Int32, Int64, UInt32


class NativeSamplingParams(BaseModel):
    """SGLang's `sampling_params` dict; unknown keys are ignored as SGLang's clients send many."""

    model_config = ConfigDict(extra="ignore")

    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: UInt32 | None = None
    min_new_tokens: UInt32 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool = False
    n: int | None = Field(None, ge=1, le=2**32 - 1)
    seed: Int64 | None = None
    sampling_seed: Int64 | None = None  # SGLang's name for the per-request seed
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateReqInput(BaseModel):
    """POST /generate: one prompt or a batch (a list of texts or of token-id lists)."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[Int32] | list[list[Int32]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    top_logprobs_num: UInt32 | list[UInt32] = 0
    # With return_logprob, score the prompt from this position (input_token_logprobs); -1: no.
    logprob_start_len: Int32 | list[Int32] = -1
    rid: str | list[str] | None = None
    return_timings: bool = False
    model: str | None = None


class AbortReq(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False
