"""SGLang-native request models (/generate, /abort_request), with SGLang's field names."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from gateway.protocol import ApiRequest, Int32, Int64, SamplingFields, UInt32


class NativeSamplingParams(SamplingFields):
    """SGLang's `sampling_params` dict (unknown keys: see ApiRequest)."""

    # OpenAI's requests call these max_tokens / min_tokens, so they are not in SamplingFields.
    max_new_tokens: UInt32 | None = None
    min_new_tokens: UInt32 | None = None
    sampling_seed: Int64 | None = None  # SGLang's name for the per-request seed


class GenerateReqInput(ApiRequest):
    """POST /generate: one prompt or a batch (a list of texts or of token-id lists)."""

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
