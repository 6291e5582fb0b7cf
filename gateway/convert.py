"""HTTP request models -> GenerateRequest protobuf, and protobuf pieces -> JSON shapes.

The gateway only renames and reshapes: validation of values (ranges, lengths, the model's
context) is the tokenizer's job, and its INVALID_ARGUMENT names the field in protobuf terms;
OPENAI_PARAMS maps those names back to what an OpenAI client sent.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import grpc
from pydantic import BaseModel

from gateway.errors import GatewayError, from_status
from gateway.native_protocol import NativeSamplingParams
from gateway.protocol import ChatFields, ChatMessage, Prompt, SamplingExtras
from ringserve.errors import status_of
from ringserve.message.sampling import CONSTRAINTS
from ringserve.v1 import api_pb2 as pb
from ringserve.v1 import common_pb2

_SAMPLING_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
OPENAI_PARAMS: dict[str, str] = {
    **{f"sampling_params.{f.name}": _SAMPLING_RENAMES.get(f.name, f.name)
       for f in common_pb2.SamplingParams.DESCRIPTOR.fields},
    "text": "prompt", "input_ids": "prompt", "chat": "messages", "chat.messages": "messages",
    "top_logprobs_num": "logprobs", "model": "model", "chat.tool_choice": "tool_choice", "chat.tools": "tools",
    "chat.chat_template_kwargs_json": "chat_template_kwargs",
}
CHAT_PARAMS = {**OPENAI_PARAMS, "top_logprobs_num": "top_logprobs",
               "sampling_params.max_new_tokens": "max_completion_tokens"}


_SAMPLING_PB_FIELDS = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
_TOKEN_KEY = re.compile(r"-?[0-9]+")


def sampling_pb(req: BaseModel, **renamed: Any) -> common_pb2.SamplingParams:
    """Every field of `req` that common.SamplingParams has, copied by name, plus `renamed` (values the
    request names otherwise, under their proto names). None stays unset: proto3 `optional` fields
    then mean "the tokenizer's default"."""
    values = {name: getattr(req, name) for name in type(req).model_fields if name in _SAMPLING_PB_FIELDS}
    values.update(renamed)
    sp = common_pb2.SamplingParams()
    for name, value in values.items():
        if value is None:
            continue
        if name == "logit_bias":
            sp.logit_bias.update(logit_bias_ids(value))
        elif _SAMPLING_PB_FIELDS[name].is_repeated:
            getattr(sp, name).extend([value] if isinstance(value, str) else value)  # stop: one string or a list
        else:
            setattr(sp, name, value)
    return sp


def logit_bias_ids(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's {"token id": bias} (JSON keys are strings) with int keys; the tokenizer checks the ids
    against the vocabulary and the values' range. A key that is no int32 is a 400 here."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(key):  # int() alone would also take " 5", "1_0" and non-ASCII digits
            raise GatewayError(400, f"logit_bias: key {key!r} is not a token id", param="logit_bias")
        token = int(key)
        if not -(2**31) <= token < 2**31:
            raise GatewayError(400, f"logit_bias: token id {token} is out of range", param="logit_bias")
        out[token] = value
    return out


def sampling_from_openai(req: SamplingExtras, max_tokens: int | None) -> common_pb2.SamplingParams:
    sp = sampling_pb(req, max_new_tokens=max_tokens, min_new_tokens=req.min_tokens)
    schema = response_format_schema(req)
    if schema is not None:
        sp.json_schema = schema
    return sp


# response_format json_object: any JSON object. A schema rather than a backend's built-in JSON
# grammar: it keeps the wire backend-neutral (sampling_params.json_schema) and, unlike xgrammar's
# builtin grammar, excludes a top-level array or scalar, as OpenAI's JSON mode does.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def response_format_schema(req: SamplingExtras) -> str | None:
    """The sampling_params.json_schema that req.response_format asks for, or None for none/text."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    other = [n for n in CONSTRAINTS if getattr(req, n) is not None]
    if other:
        raise GatewayError(400, f"response_format: cannot be combined with {other[0]}", param="response_format")
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise GatewayError(400, "response_format.json_schema.schema: required for type json_schema",
                           param="response_format.json_schema.schema")
    return json.dumps(fmt.json_schema.schema_, separators=(",", ":"))


def openai_param_map(base: dict[str, str], req: SamplingExtras) -> dict[str, str]:
    """base, except that a schema the scheduler rejects is blamed on response_format when it came from there."""
    if req.response_format is None or req.response_format.type == "text":
        return base
    return {**base, "sampling_params.json_schema": "response_format"}


def sampling_from_native(sp_in: NativeSamplingParams | None) -> common_pb2.SamplingParams:
    sp_in = sp_in or NativeSamplingParams()
    return sampling_pb(sp_in, seed=sp_in.seed if sp_in.seed is not None else sp_in.sampling_seed)


def split_prompt(prompt: Prompt) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> one entry per prompt (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise GatewayError(400, "prompt: must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def set_prompt(req: pb.GenerateRequest, prompt: str | list[int]) -> None:
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.input_ids.ids.extend(prompt)


def message_text(msg: ChatMessage, i: int) -> str:
    """A message's content as one string; text parts are joined with a space, as SGLang does."""
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    texts = []
    for j, part in enumerate(msg.content):
        if part.type != "text" or part.text is None:
            raise GatewayError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                               param=f"messages.{i}.content")
        texts.append(part.text)
    return " ".join(texts)


def chat_message(msg: ChatMessage, i: int) -> pb.ChatMessage:
    out = pb.ChatMessage(role=msg.role, content=message_text(msg, i), name=msg.name or "",
                         tool_call_id=msg.tool_call_id or "", reasoning_content=msg.reasoning_content or "")
    for call in msg.tool_calls or []:
        out.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.arguments)
    return out


def chat_input(req: ChatFields) -> pb.ChatInput:
    chat = pb.ChatInput(messages=[chat_message(m, i) for i, m in enumerate(req.messages or [])],
                        continue_final_message=req.continue_final_message)
    if req.add_generation_prompt is not None:
        chat.add_generation_prompt = req.add_generation_prompt
    for t in req.tools or []:
        fn = t.function
        tool = chat.tools.add(name=fn.name, description=fn.description or "",
                              parameters_json=json.dumps(fn.parameters) if fn.parameters is not None else "")
        if fn.strict is not None:
            tool.strict = fn.strict
    if isinstance(req.tool_choice, str):
        chat.tool_choice.mode = req.tool_choice
    elif req.tool_choice is not None:
        chat.tool_choice.function = req.tool_choice.function.name
    if req.parallel_tool_calls is not None:
        chat.parallel_tool_calls = req.parallel_tool_calls
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if kwargs:
        chat.chat_template_kwargs_json = json.dumps(kwargs)
    chat.separate_reasoning = req.separate_reasoning
    return chat


def tool_calls_json(calls: list[pb.ToolCallDelta], stream: bool) -> list[dict[str, Any]]:
    """OpenAI's tool_calls: whole calls in a message; in a stream delta, a call's first piece
    carries index, id, type and name, later ones only index and argument text."""
    out: list[dict[str, Any]] = []
    for c in calls:
        if not stream:
            out.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
        elif c.id:
            out.append({"index": c.index, "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}})
        else:
            out.append({"index": c.index, "function": {"arguments": c.arguments}})
    return out


def finish_error(fr: common_pb2.FinishReason, param_map: dict[str, str] | None = None) -> GatewayError:
    """An "abort" finish as an error; a clean abort (code 0) was asked for, hence CANCELLED."""
    code = status_of(fr.status_code) if fr.status_code else grpc.StatusCode.CANCELLED
    return from_status(code, fr.message or "request aborted", param_map)


def matched(fr: common_pb2.FinishReason) -> int | str | None:
    which = fr.WhichOneof("matched")
    return getattr(fr, which) if which else None


def native_finish_reason(fr: common_pb2.FinishReason, completion_tokens: int) -> dict[str, Any] | None:
    """SGLang's meta_info.finish_reason shapes."""
    if not fr.type:
        return None
    if fr.type == "stop":
        return {"type": "stop", "matched": matched(fr)}
    if fr.type == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": fr.type, "message": fr.message, "status_code": fr.status_code or None}


def _scored(lp: common_pb2.TokenLogprob) -> bool:
    """False for a prompt's first token, which nothing predicts (its logprob travels as NaN)."""
    return not math.isnan(lp.logprob)


def native_logprobs(lps: list[common_pb2.TokenLogprob], top_n: int) -> tuple[list[Any], list[Any] | None]:
    """SGLang: output_token_logprobs [[logprob, id, text]], output_top_logprobs [[[lp, id, text], ...]]
    (the same shape for input_token_logprobs, None where a prompt position has no logprob)."""
    tokens = [[lp.logprob if _scored(lp) else None, lp.token_id, lp.token or None] for lp in lps]
    if top_n <= 0:
        return tokens, None
    tops = [[[t.logprob, t.token_id, t.token or None] for t in lp.top_logprobs] if _scored(lp) else None
            for lp in lps]
    return tokens, tops


def completion_logprobs(lps: list[common_pb2.TokenLogprob], start_offset: int) -> dict[str, Any]:
    """Legacy completions shape; text_offset counts characters from the start of the choice text."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = start_offset
    for lp in lps:
        scored = _scored(lp)  # with echo, the prompt's first token has no logprob: null, as OpenAI's
        out["tokens"].append(lp.token)
        out["token_logprobs"].append(lp.logprob if scored else None)
        out["top_logprobs"].append({t.token: t.logprob for t in lp.top_logprobs} if scored else None)
        out["text_offset"].append(offset)
        offset += len(lp.token)
    return out


def echo_logprobs(prompt: list[common_pb2.TokenLogprob], output: list[common_pb2.TokenLogprob],
                  echo_len: int) -> dict[str, Any]:
    """Completions with echo: the prompt's tokens, then the output's (offsets from echo_len). The
    prompt's offsets end where the echoed text does: a BOS token the text does not show sits at 0."""
    head, tail = completion_logprobs(prompt, 0), completion_logprobs(output, echo_len)
    shift = echo_len - sum(len(lp.token) for lp in prompt)
    head["text_offset"] = [max(0, o + shift) for o in head["text_offset"]]
    return {k: head[k] + tail[k] for k in head}


def chat_logprobs(lps: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode("utf-8")),
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
                          for t in lp.top_logprobs]}
        for lp in lps]}
