"""The tokenizer's public-API types from protobuf: chat tools, tool_choice and template kwargs."""

from __future__ import annotations

import json

import pytest

from ringserve.errors import InvalidArgument
from ringserve.v1 import api_pb2
from services.tokenizer.io_struct import ChatInput

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}


def _chat(**kw: object) -> api_pb2.ChatInput:
    chat = api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="user", content="hi")])
    chat.tools.add(name="get_weather", description="d", parameters_json=json.dumps(PARAMS))
    for k, v in kw.items():
        if k == "mode":
            chat.tool_choice.mode = str(v)
        elif k == "function":
            chat.tool_choice.function = str(v)
        else:
            setattr(chat, k, v)
    return chat


def test_tools_and_defaults() -> None:
    chat = ChatInput.from_pb(_chat())
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls and chat.separate_reasoning
    assert chat.template_tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "d", "parameters": PARAMS}}]
    bare = ChatInput.from_pb(api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="user", content="hi")]))
    assert bare.tool_choice == "none" and bare.template_tools is None


def test_history_calls_become_template_objects() -> None:
    pb = api_pb2.ChatInput()
    m = pb.messages.add(role="assistant", content="")
    m.tool_calls.add(id="call_1", name="f", arguments='{"a": 1}')
    m.tool_calls.add(id="call_2", name="g", arguments="not json")
    pb.messages.add(role="tool", content="ok", tool_call_id="call_1")
    msgs = ChatInput.from_pb(pb).messages
    assert msgs[0]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
        {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]
    assert msgs[1] == {"role": "tool", "content": "ok", "tool_call_id": "call_1"}


def test_thinking_switch_comes_from_template_kwargs() -> None:
    assert not ChatInput.from_pb(_chat(chat_template_kwargs_json='{"enable_thinking": false}')).thinking_enabled
    assert ChatInput.from_pb(_chat()).thinking_enabled


@pytest.mark.parametrize(("kw", "field"), [
    ({"function": "nope"}, "chat.tool_choice"),
    ({"mode": "sometimes"}, "chat.tool_choice"),
    ({"chat_template_kwargs_json": "[1]"}, "chat.chat_template_kwargs_json"),
    ({"chat_template_kwargs_json": "{"}, "chat.chat_template_kwargs_json"),
    ({"chat_template_kwargs_json": '{"messages": []}'}, "chat.chat_template_kwargs_json"),
])
def test_bad_values_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        ChatInput.from_pb(_chat(**kw))
    assert e.value.message.startswith(field + ":")


def test_required_without_tools_and_bad_parameters() -> None:
    pb = api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="user", content="hi")])
    pb.tool_choice.mode = "required"
    with pytest.raises(InvalidArgument, match="chat.tool_choice"):
        ChatInput.from_pb(pb)
    pb = _chat()
    pb.tools[0].parameters_json = "[]"
    with pytest.raises(InvalidArgument, match=r"chat.tools\[0\].parameters_json"):
        ChatInput.from_pb(pb)
