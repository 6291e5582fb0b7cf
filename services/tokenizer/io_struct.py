"""The tokenizer's own public-API types, each owning its protobuf conversion (as TGI's `from_pb`/`to_pb`).

Named after SGLang's io_struct: what comes in (GenerateInput, ChatInput) and what goes out
(GenerateOutput). What travels inside the ring (sampling parameters, TokenizedReq, TextDelta, Finish,
Logprob, Timings, Load) is ringserve.message's, not redeclared here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ringserve.errors import InvalidArgument
from ringserve.message import Finish, Logprob, SamplingParams, Timings
from ringserve.text_tokenizer import RESERVED_TEMPLATE_VARIABLES
from ringserve.v1 import api_pb2

from .parsers.tool_calls import ToolCallDelta

TOOL_CHOICE_MODES = ("none", "auto", "required")


def _json_field(text: str, name: str, kind: type) -> Any:
    """A JSON-text field of the request, parsed; INVALID_ARGUMENT naming it when it is not a `kind`."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(name, f"not valid JSON: {e}") from None
    if not isinstance(value, kind):
        raise InvalidArgument(name, f"must be a JSON {kind.__name__}")
    return value


@dataclass(frozen=True)
class Tool:
    """A function the model may call (OpenAI's tools[].function)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None

    @classmethod
    def from_pb(cls, pb: api_pb2.Tool, i: int) -> Tool:
        if not pb.name:
            raise InvalidArgument(f"chat.tools[{i}].name", "required")
        params = _json_field(pb.parameters_json, f"chat.tools[{i}].parameters_json", dict) \
            if pb.parameters_json else None
        return cls(name=pb.name, description=pb.description, parameters=params,
                   strict=pb.strict if pb.HasField("strict") else None)

    def to_template(self) -> dict[str, Any]:
        """The shape chat templates read (transformers passes OpenAI's tool dicts)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


def _template_message(m: api_pb2.ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it. A call's arguments are handed over as an object, as
    vLLM and SGLang do: templates render them with `tojson`, which would quote a JSON string again."""
    msg: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        msg["name"] = m.name
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args: Any = json.loads(c.arguments) if c.arguments else {}
            except ValueError:
                args = c.arguments  # not JSON: the template gets the text as written
            calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}})
        msg["tool_calls"] = calls
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        msg["reasoning_content"] = m.reasoning_content
    return msg


@dataclass(frozen=True)
class ChatInput:
    """A conversation, its tools and how the template renders it. `messages` are template-ready dicts."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "none"  # TOOL_CHOICE_MODES, or "function" (call `tool_name`)
    tool_name: str = ""
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    separate_reasoning: bool = True

    @classmethod
    def from_pb(cls, pb: api_pb2.ChatInput) -> ChatInput:
        tools = [Tool.from_pb(t, i) for i, t in enumerate(pb.tools)]
        which = pb.tool_choice.WhichOneof("choice")
        if which == "function":
            choice, name = "function", pb.tool_choice.function
            if name not in {t.name for t in tools}:
                raise InvalidArgument("chat.tool_choice", f"function {name!r} is not among the tools")
        elif which == "mode":
            choice, name = pb.tool_choice.mode, ""
            if choice not in TOOL_CHOICE_MODES:
                raise InvalidArgument("chat.tool_choice", f"must be one of {', '.join(TOOL_CHOICE_MODES)} "
                                      f"or a function, got {choice!r}")
        else:
            choice, name = ("auto" if tools else "none"), ""
        if choice in ("required", "function") and not tools:
            raise InvalidArgument("chat.tool_choice", f"{choice!r} needs tools")
        kwargs = _json_field(pb.chat_template_kwargs_json, "chat.chat_template_kwargs_json", dict) \
            if pb.chat_template_kwargs_json else {}
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
        if reserved:
            raise InvalidArgument("chat.chat_template_kwargs_json", f"{reserved[0]!r} is set by the server")
        return cls(messages=[_template_message(m) for m in pb.messages],
                   add_generation_prompt=pb.add_generation_prompt if pb.HasField("add_generation_prompt") else True,
                   continue_final_message=pb.continue_final_message, tools=tools, tool_choice=choice,
                   tool_name=name,
                   parallel_tool_calls=pb.parallel_tool_calls if pb.HasField("parallel_tool_calls") else True,
                   template_kwargs=kwargs,
                   separate_reasoning=pb.separate_reasoning if pb.HasField("separate_reasoning") else True)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.to_template() for t in self.tools] or None

    @property
    def thinking_enabled(self) -> bool:
        """Whether the template was asked to let the model think (Qwen3's enable_thinking,
        DeepSeek V3.1's thinking); on unless a kwarg turned it off."""
        return bool(self.template_kwargs.get("enable_thinking", self.template_kwargs.get("thinking", True)))


@dataclass(frozen=True)
class GenerateInput:
    """One Generate call. Exactly one of text / input_ids / chat should be set (validation checks).

    `sampling` is the client's: unset fields hold the defaults, except max_new_tokens (None until
    validation resolves it against the prompt and the context length)."""

    rid: str = ""
    text: str | None = None
    input_ids: list[int] | None = None
    chat: ChatInput | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_timings: bool = False
    model: str = ""
    logprob_start_len: int = -1  # with return_logprob: score the prompt from here (-1: no)
    lora_path: str = ""          # a loaded LoRA adapter's name (SGLang's field name); "": none

    @classmethod
    def from_pb(cls, pb: api_pb2.GenerateRequest) -> GenerateInput:
        which = pb.WhichOneof("input")
        return cls(
            rid=pb.rid, text=pb.text if which == "text" else None,
            input_ids=list(pb.input_ids.ids) if which == "input_ids" else None,
            chat=ChatInput.from_pb(pb.chat) if which == "chat" else None,
            sampling=SamplingParams.from_pb(pb.sampling_params), stream=pb.stream,
            return_logprob=pb.return_logprob, top_logprobs_num=pb.top_logprobs_num,
            return_timings=pb.return_timings, model=pb.model,
            logprob_start_len=pb.logprob_start_len if pb.HasField("logprob_start_len") else -1,
            lora_path=pb.lora_path)


@dataclass
class GenerateOutput:
    """One message of a Generate stream."""

    rid: str
    index: int
    text: str
    output_ids: list[int]
    logprobs: list[Logprob]
    finished: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_logprobs: list[Logprob] = field(default_factory=list)  # the prompt's, on the first output
    finish: Finish | None = None
    e2e_latency: float = 0.0
    timings: Timings | None = None  # with return_timings, on the last output
    reasoning_text: str = ""  # chat with a reasoning parser: the thinking; `text` holds the answer
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # chat with tools
    weight_version: str = "default"  # of the weights of the scheduler serving it

    def to_pb(self, resp: api_pb2.GenerateResponse | None = None) -> api_pb2.GenerateResponse:
        """This output in `resp` (an empty message, e.g. one just added to a batch: built in place, not
        copied there) or a new message."""
        # Once per request per step: meta_info is filled in place (a MetaInfo passed to the constructor
        # is copied), and the fields most outputs leave empty are set only when they are not.
        if resp is None:
            resp = api_pb2.GenerateResponse()
        resp.rid, resp.index, resp.text, resp.finished = self.rid, self.index, self.text, self.finished
        resp.output_ids.extend(self.output_ids)
        meta = resp.meta_info
        meta.id, meta.prompt_tokens, meta.completion_tokens = self.rid, self.prompt_tokens, self.completion_tokens
        meta.cached_tokens, meta.weight_version = self.cached_tokens, self.weight_version
        if self.finished:
            if self.finish is not None:
                meta.finish_reason.CopyFrom(self.finish.to_pb())
            meta.e2e_latency = self.e2e_latency
            if self.timings is not None:
                meta.timings.CopyFrom(self.timings.to_pb())
        if self.logprobs:
            resp.logprobs.extend(Logprob.list_to_pb(self.logprobs))
        if self.input_logprobs:
            resp.input_logprobs.extend(Logprob.list_to_pb(self.input_logprobs))
        if self.reasoning_text:
            resp.reasoning_text = self.reasoning_text
        if self.tool_calls:
            resp.tool_calls.extend(c.to_pb() for c in self.tool_calls)
        return resp
