"""SGLang-native routes: /generate, /health, /health_generate, /get_model_info, /get_server_info,
/flush_cache, /tokenize, /detokenize (operations: operation_routes.py). Shapes follow SGLang's http_server so its
clients work unchanged (the tokenize pair also takes vLLM's fields)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from google.protobuf.json_format import MessageToDict

from gateway.convert import chat_input, native_finish_reason, native_logprobs, sampling_from_native, set_prompt
from gateway.errors import GatewayError
from gateway.native_protocol import GenerateReqInput
from gateway.openai_routes import ERRORS, STREAM_DOC
from gateway.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from gateway.sse import prime, sse_response
from gateway.state import get_state
from gateway.streams import Sample, cancel_on_disconnect, collect, merge
from ringserve.v1 import api_pb2 as pb

log = logging.getLogger(__name__)
router = APIRouter(tags=["sglang"])
HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass
class _Item:
    req: pb.GenerateRequest
    top_n: int


def _pick(value: Any, i: int, batch: int, name: str) -> Any:
    """A per-prompt field: one value for all prompts, or a list with one per prompt."""
    if isinstance(value, list):
        if len(value) != batch:
            raise GatewayError(400, f"{name}: expected {batch} values, got {len(value)}", param=name)
        return value[i]
    return value


def _items(body: GenerateReqInput) -> tuple[list[_Item], bool]:
    """The request as one GenerateRequest per prompt; True when the input was a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise GatewayError(400, "text: exactly one of text and input_ids is required", param="text")
    if body.text is not None:
        prompts: list[str | list[int]] = [body.text] if isinstance(body.text, str) else list(body.text)
        is_batch = isinstance(body.text, list)
    else:
        ids = body.input_ids or []
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = list(ids) if is_batch else [ids]  # type: ignore[arg-type,list-item]
    if not prompts:
        raise GatewayError(400, "text: empty batch", param="text")
    items = []
    for i, prompt in enumerate(prompts):
        rid = _pick(body.rid, i, len(prompts), "rid") or uuid.uuid4().hex
        top_n = int(_pick(body.top_logprobs_num, i, len(prompts), "top_logprobs_num") or 0)
        req = pb.GenerateRequest(
            rid=rid, stream=body.stream, top_logprobs_num=top_n, return_timings=body.return_timings,
            return_logprob=bool(_pick(body.return_logprob, i, len(prompts), "return_logprob")),
            lora_path=_pick(body.lora_path, i, len(prompts), "lora_path") or "",
            sampling_params=sampling_from_native(_pick(body.sampling_params, i, len(prompts), "sampling_params")))
        start = int(_pick(body.logprob_start_len, i, len(prompts), "logprob_start_len"))
        if req.return_logprob and start != -1:
            req.logprob_start_len = start  # the tokenizer refuses what is not a position
        set_prompt(req, prompt)
        items.append(_Item(req, top_n))
    return items, is_batch


def _output(item: _Item, sample: Sample, index: int | None) -> dict[str, Any]:
    m = sample.meta_info
    meta: dict[str, Any] = {
        "id": m.id or item.req.rid, "finish_reason": native_finish_reason(m.finish_reason, m.completion_tokens),
        "prompt_tokens": m.prompt_tokens, "completion_tokens": m.completion_tokens,
        "cached_tokens": m.cached_tokens, "weight_version": m.weight_version or "default"}
    if sample.finished:
        meta["e2e_latency"] = m.e2e_latency
    if item.req.return_logprob:
        meta["output_token_logprobs"], tops = native_logprobs(sample.logprobs, item.top_n)
        if tops is not None:
            meta["output_top_logprobs"] = tops
        if item.req.HasField("logprob_start_len"):
            meta["input_token_logprobs"], tops = native_logprobs(sample.input_logprobs, item.top_n)
            if tops is not None:
                meta["input_top_logprobs"] = tops
    if m.HasField("timings"):
        meta["timings"] = MessageToDict(m.timings, preserving_proto_field_name=True)
    # output_ids as is, not a copy: each event is serialized before the next message is absorbed.
    out: dict[str, Any] = {"text": sample.text, "output_ids": sample.output_ids, "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def _n(item: _Item) -> int:
    sp = item.req.sampling_params
    return sp.n if sp.HasField("n") and sp.n > 0 else 1


async def _stream_events(items: list[_Item], streams: list[AsyncIterator[pb.GenerateResponse]],
                         indexed: bool) -> AsyncIterator[dict[str, Any]]:
    """SGLang's stream: each event carries the cumulative text and ids of one sample."""
    samples: dict[tuple[int, int], Sample] = {}
    first_index = [0, *accumulate(_n(it) for it in items[:-1])]  # a prompt's first choice index
    gen = merge(streams)
    try:
        async for pi, msg in gen:
            key = (pi, msg.index)
            s = samples.get(key)
            if s is None:
                s = samples[key] = Sample(msg.index)
            s.absorb(msg)
            if not (msg.text or msg.output_ids or msg.finished):
                continue
            yield _output(items[pi], s, first_index[pi] + msg.index if indexed else None)
    finally:
        await gen.aclose()


@router.post("/generate", responses={
    **ERRORS, 200: {"content": STREAM_DOC, "description": "an output, a list of outputs, or SSE events"}})
async def generate(body: GenerateReqInput, request: Request) -> Any:
    state = get_state(request)
    body.check_fields()
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
    for sp in sps:
        if sp is not None:
            sp.check_fields()
    model = await state.check_model(body.model) if body.model else ""
    items, is_batch = _items(body)
    for it in items:
        if not it.req.lora_path and model:
            it.req.lora_path = await state.lora_of(model, None)  # the model named an adapter (vLLM's way)
    indexed = is_batch or any(_n(it) > 1 for it in items)
    for it in items:
        log.info("rid=%s generate stream=%s", it.req.rid, body.stream)
    streams = [state.backend.generate(it.req) for it in items]
    if body.stream:
        events = await cancel_on_disconnect(request, prime(_stream_events(items, streams, indexed)))
        return sse_response(events, items[0].req.rid)
    results = await cancel_on_disconnect(request, collect(streams))
    outputs = [_output(items[pi], samples[j], None) for pi, samples in enumerate(results) for j in sorted(samples)]
    return outputs if indexed else outputs[0]


TOKENIZE_PARAMS = {"chat": "messages", "chat.messages": "messages", "text": "prompt", "chat.tools": "tools",
                   "chat.tool_choice": "tool_choice", "chat.chat_template_kwargs_json": "chat_template_kwargs"}


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True, responses=ERRORS)
@router.post("/v1/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True, responses=ERRORS,
             include_in_schema=False)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """Text, a list of texts, or chat messages (rendered with the chat template, tools included)
    to token ids; SGLang's and vLLM's shapes."""
    state = get_state(request)
    body.check_fields()
    if body.model:
        await state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise GatewayError(400, "prompt: exactly one of prompt or messages is required", param="prompt")
    if body.messages is not None:
        reqs = [pb.TokenizeRequest(chat=chat_input(body))]
    else:
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt or [])
        reqs = [pb.TokenizeRequest(text=p, add_special_tokens=body.add_special_tokens) for p in prompts]
    try:
        resps = await asyncio.gather(*(state.backend.tokenize(r) for r in reqs))
    except GatewayError as e:
        raise e.renamed(TOKENIZE_PARAMS) from None
    strs = [list(r.tokens) for r in resps] if body.return_token_strs else None
    max_len = resps[0].max_model_len if resps else (await state.backend.model_info()).max_context_length
    if isinstance(body.prompt, list):
        return TokenizeResponse(tokens=[list(r.ids) for r in resps], count=[r.count for r in resps],
                                max_model_len=max_len, token_strs=strs)
    return TokenizeResponse(tokens=list(resps[0].ids), count=resps[0].count, max_model_len=max_len,
                            token_strs=strs[0] if strs else None)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
@router.post("/v1/detokenize", response_model=DetokenizeResponse, responses=ERRORS, include_in_schema=False)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """Token ids (or a list of id lists) to text; SGLang's and vLLM's shapes."""
    state = get_state(request)
    body.check_fields()
    if body.model:
        await state.check_model(body.model)
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    seqs: list[list[int]] = body.tokens if batch else [body.tokens]  # type: ignore[assignment,list-item]
    try:
        texts = await asyncio.gather(*(state.backend.detokenize(ids, body.skip_special_tokens) for ids in seqs))
    except GatewayError as e:
        raise e.renamed({"ids": "tokens"}) from None
    text: str | list[str] = list(texts) if batch else texts[0]
    return DetokenizeResponse(text=text, prompt=text)


@router.get("/health", responses={503: {"model": ERRORS[503]["model"]}})
async def health(request: Request) -> Response:
    """200 only while the tokenizer reports SERVING on grpc.health."""
    backend = get_state(request).backend
    if not await backend.serving():
        raise GatewayError(503, "tokenizer is not serving", headers={"Retry-After": "1"})
    paused = (await backend.server_info()).paused
    if paused:  # up (requests are accepted and queue), but nothing generates until /continue_generation
        return JSONResponse({"status": "paused", "mode": paused})
    return Response(status_code=200)


@router.get("/health_generate", responses={503: {"model": ERRORS[503]["model"]}})
async def health_generate(request: Request) -> Response:
    """Generate one token end to end (through tokenizer, scheduler and detokenizer)."""
    req = pb.GenerateRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=pb.TokenIds(ids=[0]),
                             sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    try:
        await asyncio.wait_for(collect([get_state(request).backend.generate(req)]), HEALTH_GENERATE_TIMEOUT_S)
    except (GatewayError, TimeoutError) as e:
        raise GatewayError(503, f"health generation failed: {getattr(e, 'message', 'timeout')}",
                           headers={"Retry-After": "1"}) from None
    return Response(status_code=200)


@router.get("/get_model_info", responses=ERRORS)
async def get_model_info(request: Request) -> dict[str, Any]:
    state = get_state(request)
    info = await state.backend.fresh_model_info()  # weight_version changes with weight updates
    return {"model_path": info.model_path, "tokenizer_path": info.model_path, "is_generation": info.is_generation,
            "served_model_name": await state.served_name(), "max_context_length": info.max_context_length,
            "vocab_size": info.vocab_size, "eos_token_ids": list(info.eos_token_ids),
            "has_chat_template": info.has_chat_template, "preferred_sampling_params": None,
            "weight_version": info.weight_version or "default",
            "architectures": [info.architecture] if info.architecture else [],
            "supported_architectures": list(info.supported_architectures)}


@router.get("/get_server_info", responses=ERRORS)
async def get_server_info(request: Request) -> dict[str, Any]:
    state = get_state(request)
    load = MessageToDict(await state.backend.server_info(), preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
    cfg = state.config
    return {**load, "model_path": (await state.backend.model_info()).model_path,
            "served_model_name": await state.served_name(),
            "gateway": {"host": cfg.host, "port": cfg.port, "tokenizer": cfg.tokenizer,
                        "max_body_bytes": cfg.max_body, "auth": bool(cfg.api_keys())}}


@router.post("/flush_cache", responses=ERRORS)
async def flush_cache(request: Request) -> PlainTextResponse:
    resp = await get_state(request).backend.flush_cache()
    if not resp.success:
        raise GatewayError(400, f"Cache not flushed: {resp.message}", param=None)
    return PlainTextResponse("Cache flushed.\n")


router.add_api_route("/flush_cache", flush_cache, methods=["GET"], operation_id="flush_cache_get",
                     responses=ERRORS, include_in_schema=True)
