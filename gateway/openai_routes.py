"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.convert import (
    CHAT_PARAMS,
    OPENAI_PARAMS,
    chat_input,
    openai_param_map,
    sampling_from_openai,
    set_prompt,
    split_prompt,
)
from gateway.errors import GatewayError
from gateway.openai_render import RenderSpec, render_full, render_stream
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from gateway.sse import prime, sse_response
from gateway.state import GatewayState, get_state
from gateway.streams import cancel_on_disconnect, collect
from ringserve.v1 import api_pb2 as pb

log = logging.getLogger(__name__)

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503, 504)}
STREAM_DOC = {"text/event-stream": {"schema": {"type": "string"},
                                    "example": 'data: {"choices": [...]}\n\ndata: [DONE]\n\n'}}

router = APIRouter(tags=["openai"])


async def _run(request: Request, state: GatewayState, spec: RenderSpec,
               reqs: list[pb.GenerateRequest], stream: bool) -> Response | Any:
    for r in reqs:
        log.info("rid=%s %s stream=%s n=%d", r.rid, "chat" if spec.chat else "completion", stream, spec.n)
    streams = [state.backend.generate(r, spec.param_map) for r in reqs]
    if stream:
        events = await cancel_on_disconnect(request, prime(render_stream(spec, streams)))
        return sse_response(events, spec.rid)
    results = await cancel_on_disconnect(request, collect(streams))
    return render_full(spec, results)


@router.post("/v1/completions", response_model=CompletionResponse, responses={
    **ERRORS, 200: {"content": STREAM_DOC, "description": "JSON, or SSE chunks when stream=true"}})
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = get_state(request)
    body.check_fields()
    model = await state.check_model(body.model)
    if body.best_of not in (None, 1):
        raise GatewayError(400, "best_of: only 1 is supported", param="best_of")
    if body.suffix:
        raise GatewayError(400, "suffix: not supported", param="suffix")
    prompts = split_prompt(body.prompt)
    rid = body.rid or f"cmpl-{uuid.uuid4().hex}"
    sp = sampling_from_openai(body, body.max_tokens)
    reqs = []
    for i, prompt in enumerate(prompts):
        req = pb.GenerateRequest(rid=rid if len(prompts) == 1 else f"{rid}-p{i}", sampling_params=sp,
                                 stream=body.stream, return_logprob=body.logprobs is not None,
                                 top_logprobs_num=body.logprobs or 0,
                                 lora_path=await state.lora_of(model, body.lora_path))
        if body.echo and body.logprobs is not None:
            req.logprob_start_len = 0  # echoed prompt tokens get logprobs too (lm-eval's loglikelihood)
        set_prompt(req, prompt)
        reqs.append(req)
    echo: list[str] = []
    if body.echo:
        echo = [p if isinstance(p, str) else await state.backend.detokenize(p) for p in prompts]
    spec = RenderSpec(rid=rid, model=model, n=body.n, chat=False,
                      param_map=openai_param_map(OPENAI_PARAMS, body),
                      logprobs=body.logprobs is not None, echo=echo,
                      include_usage=bool(body.stream_options and body.stream_options.include_usage))
    return await _run(request, state, spec, reqs, body.stream)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
    **ERRORS, 200: {"content": STREAM_DOC, "description": "JSON, or SSE chunks when stream=true"}})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = get_state(request)
    body.check_fields()
    model = await state.check_model(body.model)
    rid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise GatewayError(400, "top_logprobs: requires logprobs=true", param="top_logprobs")
    req = pb.GenerateRequest(rid=rid, chat=chat_input(body), sampling_params=sampling_from_openai(body, max_tokens),
                             stream=body.stream, return_logprob=body.logprobs, top_logprobs_num=top,
                             lora_path=await state.lora_of(model, body.lora_path))
    spec = RenderSpec(rid=rid, model=model, n=body.n, chat=True, param_map=openai_param_map(CHAT_PARAMS, body),
                      logprobs=body.logprobs,
                      include_usage=bool(body.stream_options and body.stream_options.include_usage))
    return await _run(request, state, spec, [req], body.stream)


async def _cards(state: GatewayState) -> list[ModelCard]:
    """The served model, then each loaded LoRA adapter (vLLM lists them, parent: the base model)."""
    name = await state.served_name()
    info = await state.backend.fresh_model_info()
    length = info.max_context_length or None
    return [ModelCard(id=name, root=info.model_path, max_model_len=length),
            *(ModelCard(id=a.name, root=a.path, parent=name, max_model_len=length) for a in info.lora_adapters)]


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=await _cards(get_state(request)))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
async def get_model(model_id: str, request: Request) -> ModelCard:
    state = get_state(request)
    name = await state.check_model(model_id)
    return next(c for c in await _cards(state) if c.id == name)
