"""SGLang-native operation routes: /abort_request (one rid or abort_all), /pause_generation,
/continue_generation, /update_weights_from_disk, /start_profile, /stop_profile, /get_load,
/load_lora_adapter, /unload_lora_adapter (and vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter).
Shapes follow SGLang's http_server (and vLLM's for its two) so RL trainers (verl, slime, OpenRLHF)
and vLLM's clients drive this server unchanged; each is one InferenceService RPC with a deadline, and,
like every route, behind the API key when one is set."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from gateway.errors import GatewayError
from gateway.native_protocol import (
    AbortReq,
    ContinueGenerationReqInput,
    LoadLoRAAdapterReqInput,
    PauseGenerationReqInput,
    ProfileReqInput,
    UnLoadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
)
from gateway.openai_routes import ERRORS
from gateway.state import get_state
from ringserve.v1 import api_pb2 as pb

log = logging.getLogger(__name__)
router = APIRouter(tags=["sglang operations"])


@router.post("/abort_request", responses=ERRORS)
async def abort_request(body: AbortReq, request: Request) -> JSONResponse:
    """Abort one request by rid, or with abort_all every request of every scheduler: each ends with
    finish_reason abort."""
    body.check_fields()
    backend = get_state(request).backend
    if body.abort_all:
        resp = await backend.control("Abort", pb.AbortRequest(abort_all=True))
        assert isinstance(resp, pb.AbortResponse)
        log.info("abort_all requested: %d request(s) aborted", resp.num_aborted)
        return JSONResponse({"abort_all": True, "num_aborted": resp.num_aborted})
    if not body.rid:
        raise GatewayError(400, "rid: required unless abort_all is true", param="rid")
    found = await backend.abort(body.rid)
    log.info("rid=%s abort requested found=%s", body.rid, found)
    return JSONResponse({"rid": body.rid, "found": found})


@router.post("/pause_generation", responses=ERRORS)
async def pause_generation(request: Request, body: PauseGenerationReqInput | None = None) -> JSONResponse:
    """Stop generating (mode abort: end every request; retract: running requests go back to the queue;
    in_place: they stay with their KV). New requests are accepted and wait until /continue_generation."""
    body = body or PauseGenerationReqInput()
    body.check_fields()
    resp = await get_state(request).backend.control("PauseGeneration", pb.PauseGenerationRequest(mode=body.mode))
    assert isinstance(resp, pb.PauseGenerationResponse)
    log.info("generation paused mode=%s requests=%d", body.mode, resp.num_requests)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok", "mode": body.mode,
                         "num_requests": resp.num_requests})


@router.post("/continue_generation", responses=ERRORS)
async def continue_generation(request: Request, body: ContinueGenerationReqInput | None = None) -> JSONResponse:
    if body is not None:
        body.check_fields()
    await get_state(request).backend.control("ContinueGeneration", pb.ContinueGenerationRequest())
    log.info("generation continued")
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/update_weights_from_disk", responses=ERRORS)
async def update_weights_from_disk(body: UpdateWeightFromDiskReqInput, request: Request) -> JSONResponse:
    """Swap in the weights of model_path (same architecture and shapes) without a restart: new
    requests wait, running ones finish on the old weights (or are aborted with abort_all_requests),
    the prefix cache is flushed. 400 with the reason (old weights kept) when refused."""
    body.check_fields()
    req = pb.UpdateWeightsFromDiskRequest(model_path=body.model_path, load_format=body.load_format or "",
                                          abort_all_requests=body.abort_all_requests,
                                          weight_version=body.weight_version or "")
    resp = await get_state(request).backend.control("UpdateWeightsFromDisk", req)
    assert isinstance(resp, pb.UpdateWeightsFromDiskResponse)
    content = {"success": resp.success, "message": resp.message, "num_paused_requests": resp.num_paused_requests,
               "weight_version": resp.weight_version}
    log.info("update_weights_from_disk %s: success=%s %s", body.model_path, resp.success, resp.message)
    return JSONResponse(content, status_code=200 if resp.success else 400)


@router.api_route("/start_profile", methods=["GET", "POST"], responses=ERRORS)
async def start_profile(request: Request, body: ProfileReqInput | None = None) -> PlainTextResponse:
    """A torch profiler trace (CPU and CUDA activities) of every scheduler's steps, for num_steps
    steps or until /stop_profile, into output_dir on the scheduler's machine."""
    body = body or ProfileReqInput()
    body.check_fields()
    req = pb.StartProfileRequest(output_dir=body.output_dir or "", activities=body.activities or [],
                                 with_stack=bool(body.with_stack), record_shapes=bool(body.record_shapes),
                                 profile_prefix=body.profile_prefix or "")
    if body.num_steps is not None:
        req.num_steps = body.num_steps
    resp = await get_state(request).backend.control("StartProfile", req)
    assert isinstance(resp, pb.StartProfileResponse)
    log.info("profile started: %s", resp.message)
    return PlainTextResponse("Start profiling.\n")


@router.api_route("/stop_profile", methods=["GET", "POST"], responses=ERRORS)
async def stop_profile(request: Request) -> PlainTextResponse:
    resp = await get_state(request).backend.control("StopProfile", pb.StopProfileRequest())
    assert isinstance(resp, pb.StopProfileResponse)
    log.info("profile stopped: %s", ", ".join(resp.trace_files))
    return PlainTextResponse("Stop profiling. This will take some time.\n" +
                             "".join(f"{f}\n" for f in resp.trace_files))


@router.get("/get_load", responses=ERRORS)
async def get_load(request: Request) -> list[dict[str, Any]]:
    """SGLang's shape: one entry per scheduler (its dp_rank is its position)."""
    resp = await get_state(request).backend.control("GetLoad", pb.InferenceServiceGetLoadRequest())
    assert isinstance(resp, pb.InferenceServiceGetLoadResponse)
    return [{"dp_rank": i, "num_reqs": ld.num_running_reqs + ld.num_queue_reqs,
             "num_waiting_reqs": ld.num_queue_reqs, "num_tokens": ld.num_used_tokens,
             "address": ld.address, "connected": ld.connected} for i, ld in enumerate(resp.loads)]




# -- LoRA adapters: every scheduler loads them; requests pick one by lora_path or by model ----------

LORA_TIMEOUT_S = 900.0  # an unload waits for the requests using the adapter (the tokenizer's default: 600 s)


async def _load_lora(body: LoadLoRAAdapterReqInput, request: Request) -> dict[str, str]:
    body.check_fields()
    req = pb.LoadLoraAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path, pinned=body.pinned)
    resp = await get_state(request).backend.control("LoadLoraAdapter", req, LORA_TIMEOUT_S)
    assert isinstance(resp, pb.LoadLoraAdapterResponse)
    log.info("lora adapter %s loaded from %s", body.lora_name, body.lora_path)
    return {a.name: a.path for a in resp.loaded_adapters}


async def _unload_lora(body: UnLoadLoRAAdapterReqInput, request: Request) -> dict[str, str]:
    body.check_fields()
    resp = await get_state(request).backend.control(
        "UnloadLoraAdapter", pb.UnloadLoraAdapterRequest(lora_name=body.lora_name), LORA_TIMEOUT_S)
    assert isinstance(resp, pb.UnloadLoraAdapterResponse)
    log.info("lora adapter %s unloaded", body.lora_name)
    return {a.name: a.path for a in resp.loaded_adapters}


@router.post("/load_lora_adapter", responses=ERRORS)
async def load_lora_adapter(body: LoadLoRAAdapterReqInput, request: Request) -> JSONResponse:
    """Load a PEFT adapter directory (as the schedulers see it) under lora_name on every scheduler;
    requests then pick it by lora_path (or by model). 400 naming what is wrong with it, 409 when the
    name is taken."""
    loaded = await _load_lora(body, request)
    return JSONResponse({"success": True, "error_message": None, "loaded_adapters": loaded})


@router.post("/unload_lora_adapter", responses=ERRORS)
async def unload_lora_adapter(body: UnLoadLoRAAdapterReqInput, request: Request) -> JSONResponse:
    """New requests naming it get 404 at once; the call returns once the requests already using it
    have finished and every scheduler has freed it (504 when they run past the deadline)."""
    loaded = await _unload_lora(body, request)
    return JSONResponse({"success": True, "error_message": None, "loaded_adapters": loaded})


@router.post("/v1/load_lora_adapter", responses=ERRORS)
async def v1_load_lora_adapter(body: LoadLoRAAdapterReqInput, request: Request) -> PlainTextResponse:
    """vLLM's route and reply; the adapter then appears in /v1/models (parent: the base model)."""
    await _load_lora(body, request)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=ERRORS)
async def v1_unload_lora_adapter(body: UnLoadLoRAAdapterReqInput, request: Request) -> PlainTextResponse:
    await _unload_lora(body, request)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
