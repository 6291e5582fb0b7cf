"""SGLang-native request models (/generate, /abort_request and the operation routes), with SGLang's field names."""

from __future__ import annotations

from typing import Literal

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
    # A loaded LoRA adapter's name (SGLang's field: one for all prompts, or one per prompt; None: base).
    lora_path: str | list[str | None] | None = None


class AbortReq(ApiRequest):
    """POST /abort_request: one request by rid, or every request (abort_all)."""

    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(ApiRequest):
    """POST /pause_generation."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(ApiRequest):
    """POST /continue_generation."""


class UpdateWeightFromDiskReqInput(ApiRequest):
    """POST /update_weights_from_disk."""

    model_path: str
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    # The cache is always flushed (it holds KV of the old weights) and the update always awaited.
    flush_cache: Literal[True] = True
    is_async: Literal[False] = False


class ProfileReqInput(ApiRequest):
    """POST /start_profile (SGLang's fields; stages, merging and memory profiles are refused)."""

    output_dir: str | None = None
    num_steps: UInt32 | None = None
    activities: list[Literal["CPU", "GPU"]] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_prefix: str | None = None
    start_step: Literal[None] = None
    profile_by_stage: Literal[False] = False
    merge_profiles: Literal[False] = False


class LoadLoRAAdapterReqInput(ApiRequest):
    """POST /load_lora_adapter (SGLang) and /v1/load_lora_adapter (vLLM)."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnLoadLoRAAdapterReqInput(ApiRequest):
    """POST /unload_lora_adapter (SGLang) and /v1/unload_lora_adapter (vLLM; lora_int_id is ignored:
    adapters are named)."""

    lora_name: str
    lora_int_id: int | None = None
