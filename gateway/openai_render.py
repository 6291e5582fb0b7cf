"""Tokenizer messages -> OpenAI completion / chat responses and stream chunks.

Choice index = prompt position * n + sample index, as OpenAI numbers choices for a list of
prompts. Each choice gets exactly one finish_reason ("stop", "length" or, for a chat sample that
called a tool, "tool_calls"); an "abort" finish is an error. Reasoning and tool calls come parsed
from the tokenizer (reasoning_text, tool_calls); this only shapes them as OpenAI does. The
streamed deltas of a choice concatenate to exactly the non-streamed text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from gateway.convert import chat_logprobs, echo_logprobs, finish_error, matched, tool_calls_json
from gateway.errors import GatewayError
from gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    ToolCallOut,
    Usage,
)
from gateway.streams import Sample, merge
from ringserve.v1 import api_pb2 as pb


@dataclass
class RenderSpec:
    """What a response needs besides the tokenizer's messages."""

    rid: str
    model: str
    n: int
    chat: bool
    param_map: dict[str, str]
    logprobs: bool = False
    echo: list[str] = field(default_factory=list)  # per prompt, for completions with echo
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


class UsageCounter:
    """prompt and cached tokens once per prompt, completion tokens summed over choices."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, prompt_i: int, msg_index: int, meta: pb.MetaInfo) -> None:
        # Once per streamed chunk: compare and store, no max() calls.
        prompt, cached, completion = meta.prompt_tokens, meta.cached_tokens, meta.completion_tokens
        if prompt > self.prompt.get(prompt_i, 0):
            self.prompt[prompt_i] = prompt
        if cached > self.cached.get(prompt_i, 0):
            self.cached[prompt_i] = cached
        if completion > self.completion.get((prompt_i, msg_index), 0):
            self.completion[(prompt_i, msg_index)] = completion

    def usage(self) -> Usage:
        p, c = sum(self.prompt.values()), sum(self.completion.values())
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached.values())))


FinishType = Literal["stop", "length", "tool_calls"]
FINISH_TYPES = ("stop", "length", "tool_calls")


def _finish(spec: RenderSpec, sample: Sample) -> FinishType:
    fr = sample.finish
    if not sample.finished:
        raise GatewayError(502, "the tokenizer ended the stream before the request finished", "server_error")
    if fr.type not in FINISH_TYPES:
        raise finish_error(fr, spec.param_map)
    return cast(FinishType, fr.type)  # checked just above


def render_full(spec: RenderSpec, results: list[dict[int, Sample]]) -> CompletionResponse | ChatCompletionResponse:
    usage = UsageCounter()
    completion_choices: list[CompletionChoice] = []
    chat_choices: list[ChatChoice] = []
    for pi, samples in enumerate(results):
        if len(samples) != spec.n:
            raise GatewayError(502, f"expected {spec.n} samples, the tokenizer sent {len(samples)}", "server_error")
        for j in sorted(samples):
            s = samples[j]
            reason = _finish(spec, s)
            usage.add(pi, j, s.meta_info)
            index = pi * spec.n + j
            if spec.chat:
                lp = ChoiceLogprobs(**chat_logprobs(s.logprobs)) if spec.logprobs else None
                calls = [ToolCallOut(**c) for c in tool_calls_json(s.tool_calls, stream=False)] or None
                message = AssistantMessage(content=s.text if s.text.strip() or not calls else None,
                                           reasoning_content=s.reasoning_text or None, tool_calls=calls)
                chat_choices.append(ChatChoice(index=index, message=message, logprobs=lp, finish_reason=reason,
                                               matched_stop=matched(s.finish)))
            else:
                echo = spec.echo[pi] if spec.echo else ""
                clp = (CompletionLogprobs(**echo_logprobs(s.input_logprobs, s.logprobs, len(echo)))
                       if spec.logprobs else None)
                completion_choices.append(CompletionChoice(index=index, text=echo + s.text, logprobs=clp,
                                                           finish_reason=reason, matched_stop=matched(s.finish)))
    if spec.chat:
        return ChatCompletionResponse(id=spec.rid, created=spec.created, model=spec.model,
                                      choices=chat_choices, usage=usage.usage())
    return CompletionResponse(id=spec.rid, created=spec.created, model=spec.model,
                              choices=completion_choices, usage=usage.usage())


async def render_stream(spec: RenderSpec,
                        streams: list[AsyncIterator[pb.GenerateResponse]]) -> AsyncIterator[dict[str, Any]]:
    """One chunk per tokenizer message (nothing is sent before the first message arrives)."""
    usage = UsageCounter()
    started: set[int] = set()
    chars: dict[int, int] = {}  # characters sent per choice, for completions' text_offset
    obj = "chat.completion.chunk" if spec.chat else "text_completion"
    gen = merge(streams)
    try:
        async for pi, msg in gen:
            meta, text, finished = msg.meta_info, msg.text, msg.finished
            fr = meta.finish_reason
            finish = fr.type if finished else None
            if finished and finish not in FINISH_TYPES:
                raise finish_error(fr, spec.param_map)
            usage.add(pi, msg.index, meta)
            index = pi * spec.n + msg.index
            first = index not in started
            if first:
                started.add(index)
            choice: dict[str, Any] = {"index": index}
            if spec.chat:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text or first:
                    delta["content"] = text
                if msg.reasoning_text:
                    delta["reasoning_content"] = msg.reasoning_text
                if msg.tool_calls:
                    delta["tool_calls"] = tool_calls_json(list(msg.tool_calls), stream=True)
                choice["delta"] = delta
                choice["logprobs"] = chat_logprobs(list(msg.logprobs)) if spec.logprobs else None
            else:
                shown = spec.echo[pi] + text if spec.echo and first else text
                offset = chars.get(index, 0)
                start = offset + (len(shown) - len(text))
                chars[index] = offset + len(shown)
                choice["text"] = shown
                choice["logprobs"] = echo_logprobs(list(msg.input_logprobs), list(msg.logprobs), start) \
                    if spec.logprobs else None
            choice["finish_reason"] = finish
            if finish is not None:
                choice["matched_stop"] = matched(fr)
            if not (first or text or finish or msg.logprobs or msg.reasoning_text or msg.tool_calls):
                continue  # nothing new for the client (e.g. a counters-only message)
            chunk = {"id": spec.rid, "object": obj, "created": spec.created, "model": spec.model,
                     "choices": [choice]}
            if spec.include_usage:
                chunk["usage"] = None
            yield chunk
        if spec.include_usage:
            yield {"id": spec.rid, "object": obj, "created": spec.created, "model": spec.model,
                   "choices": [], "usage": usage.usage().model_dump()}
    finally:
        await gen.aclose()
