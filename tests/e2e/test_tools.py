"""Tool calls and reasoning through the four real processes, driven by the official openai client.

The model is the real default one (SmolLM2-135M-Instruct), served with a ChatML template that puts
the tools in the prompt (examples/chat_templates/chatml_tools.jinja) and with the qwen3 reasoning
parser. A 135M model rarely decides to call a tool by itself, so:
- the forced forms (tool_choice "required" or a named function) are what a weak model relies on:
  the grammar makes the call valid, and the loop call -> tool result -> answer runs on them;
- the model's own markup (tool_choice "auto") and its thinking are produced with a `regex`
  constraint that writes exactly what a tool-calling or reasoning model writes, so the parsing of
  real output, split wherever the tokens fall, is what is tested.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from ringserve.v1 import api_pb2, api_pb2_grpc
from tests.e2e.stack import Stack, running_stack

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "chat_templates" / "chatml_tools.jinja"
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# What a Hermes / Qwen 2.5 model writes to call a tool (forced here with a regex: see the docstring).
CALL_MARKUP = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
THINKING = r"<think>\nThe user asks about [a-z]{3,12}\.\n</think>\n\nIt is [a-z]{3,12}\."


@pytest.fixture(scope="module")
def stack(real_model_dir: str) -> Iterator[Stack]:
    with running_stack(real_model_dir, "--chat-template", str(TEMPLATE), "--reasoning-parser", "qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0, timeout=180)


def _ask(client: Any, messages: list[Any], stream: bool, **kw: Any) -> tuple[Any, str | None, list[dict[str, Any]]]:
    """(the assistant message as a dict, finish_reason, tool calls as dicts), from a streamed response
    reassembled exactly as the openai docs say to, or from a plain one."""
    args = {"model": "SmolLM2-135M-Instruct", "messages": messages, "temperature": 0, "max_tokens": 64, **kw}
    if not stream:
        r = client.chat.completions.create(**args)
        message = r.choices[0].message
        return (message.model_dump(exclude_none=True), r.choices[0].finish_reason,
                [c.model_dump() for c in message.tool_calls or []])
    content, reasoning, finish = "", "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, "a call's first piece carries its id and name"
                calls[tc.index] = {"id": tc.id, "type": "function",
                                   "function": {"name": tc.function.name, "arguments": ""}}
            else:
                assert not tc.id, "only a call's first piece carries an id"
            calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    msg: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    ordered = [calls[i] for i in sorted(calls)]
    if ordered:
        msg["tool_calls"] = ordered
    return msg, finish, ordered


def _check_call(call: dict[str, Any], name: str) -> dict[str, Any]:
    assert call["id"].startswith("call_")
    assert call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args, dict) and isinstance(args.get("city"), str)
    return args


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_loop_with_forced_call(client: Any, stream: bool, choice: str) -> None:
    """call -> tool result -> answer, as an agent framework runs it."""
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    msg, finish, calls = _ask(client, QUESTION, stream, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert finish == "tool_calls"
    assert len(calls) >= 1
    args = _check_call(calls[0], "get_weather" if choice == "named" else calls[0]["function"]["name"])
    assert not msg.get("content"), "a forced call has no content"
    history = [*QUESTION, msg,
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps({"city": args["city"],
                                                                                     "forecast": "sunny, 22C"})}]
    answer, finish, calls = _ask(client, history, stream, tools=[WEATHER, TIME], tool_choice="auto")
    assert finish in ("stop", "length") and not calls
    assert answer["content"].strip()


def test_parallel_tool_calls_false_gives_one_call(client: Any) -> None:
    _, finish, calls = _ask(client, QUESTION, False, tools=[WEATHER, TIME], tool_choice="required",
                            parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_auto_parses_the_models_markup(client: Any, stream: bool) -> None:
    msg, finish, calls = _ask(client, QUESTION, stream, tools=[WEATHER], extra_body={"regex": CALL_MARKUP})
    assert finish == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert msg["content"] == "Let me check.\n"  # the text before the call; no markup leaks
    assert "<tool_call>" not in (msg["content"] or "")


def test_tool_choice_none_leaves_the_markup_in_content(client: Any) -> None:
    msg, finish, calls = _ask(client, QUESTION, False, tools=[WEATHER], tool_choice="none",
                              extra_body={"regex": CALL_MARKUP})
    assert finish == "stop" and not calls
    assert "<tool_call>" in msg["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_reasoning_is_separated(client: Any, stream: bool) -> None:
    msg, finish, _ = _ask(client, QUESTION, stream, extra_body={"regex": THINKING})
    assert finish == "stop"
    assert msg["reasoning_content"].strip().startswith("The user asks about")
    assert "<think>" not in msg["content"] and "</think>" not in msg["content"]
    assert msg["content"].strip().startswith("It is")


def test_separate_reasoning_false_keeps_the_thinking_in_content(client: Any) -> None:
    msg, _, _ = _ask(client, QUESTION, False, extra_body={"regex": THINKING, "separate_reasoning": False})
    assert "reasoning_content" not in msg
    assert msg["content"].startswith("<think>")


def test_grpc_clients_get_tool_calls(stack: Stack) -> None:
    chat = api_pb2.ChatInput(messages=[api_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])])
    fn = WEATHER["function"]
    chat.tools.add(name=fn["name"], description=fn["description"], parameters_json=json.dumps(fn["parameters"]))
    chat.tool_choice.function = "get_weather"
    req = api_pb2.GenerateRequest(chat=chat)
    req.sampling_params.temperature = 0
    req.sampling_params.max_new_tokens = 48
    with grpc.insecure_channel(stack.tokenizer) as ch:
        out = list(api_pb2_grpc.InferenceServiceStub(ch).Generate(req, timeout=120))
    final = out[-1]
    assert final.finished and final.meta_info.finish_reason.type == "tool_calls"
    assert [c.name for c in final.tool_calls] == ["get_weather"] and final.tool_calls[0].id.startswith("call_")
    assert "city" in json.loads(final.tool_calls[0].arguments)


def test_tool_choice_errors_name_the_field(stack: Stack) -> None:
    url = f"{stack.gateway_url}/v1/chat/completions"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "tools": [WEATHER], "regex": "a+"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={"messages": QUESTION, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.text)


def test_unsupported_fields_are_400_and_unknown_ones_are_ignored(stack: Stack) -> None:
    url = f"{stack.gateway_url}/v1/chat/completions"
    base = {"messages": QUESTION, "max_tokens": 2, "temperature": 0}
    for field, value in [("priority", 5), ("guided_json", {"type": "object"}),
                         ("use_beam_search", True), ("functions", [WEATHER["function"]])]:
        r = httpx.post(url, json={**base, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    for field, value in [("priority", 0), ("use_beam_search", False), ("a_field_no_api_defines", 1),
                         ("store", False), ("metadata", {"k": "v"})]:
        r = httpx.post(url, json={**base, field: value}, timeout=60)
        assert r.status_code == 200, (field, r.text)
    r = httpx.post(f"{stack.gateway_url}/generate",
                   json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {"x": 1}}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "custom_params", r.text


def test_tokenize_and_detokenize_over_http(stack: Stack) -> None:
    base = stack.gateway_url
    one = httpx.post(f"{base}/tokenize", json={"prompt": "The capital of France"}, timeout=30).json()
    assert one["count"] == len(one["tokens"]) > 0 and one["max_model_len"] > 0
    many = httpx.post(f"{base}/v1/tokenize", json={"prompt": ["a b", "c"], "return_token_strs": True},
                      timeout=30).json()
    assert len(many["tokens"]) == 2 and many["count"] == [len(t) for t in many["tokens"]]
    assert [len(s) for s in many["token_strs"]] == many["count"]
    chat = httpx.post(f"{base}/tokenize", json={"messages": QUESTION, "tools": [WEATHER]}, timeout=30).json()
    plain = httpx.post(f"{base}/tokenize", json={"messages": QUESTION}, timeout=30).json()
    assert chat["count"] > plain["count"], "the tools are rendered into the prompt"
    back = httpx.post(f"{base}/detokenize", json={"tokens": one["tokens"]}, timeout=30).json()
    assert back["text"] == back["prompt"] == "The capital of France"
    batch = httpx.post(f"{base}/v1/detokenize", json={"tokens": many["tokens"]}, timeout=30).json()
    assert batch["text"] == ["a b", "c"]
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**8]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(f"{base}/tokenize", json={}, timeout=30)
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"
