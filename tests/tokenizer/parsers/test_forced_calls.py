"""Forced tool calls: the schema the grammar enforces, and the parser that reads what it produced.

The schema is checked against outputs with jsonschema (what the grammar guarantees); the parser is fed
those outputs cut at every character, and must give the same calls however they were cut.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from services.tokenizer.parsers.chat_output import ChatOutput, whole_calls
from services.tokenizer.parsers.forced_calls import ForcedCallParser, forced_call_schema
from services.tokenizer.parsers.tool_calls import ToolCallDelta

WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK: dict[str, Any] = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
TOOLS = [WEATHER, CLOCK]


def _stream(parser: ForcedCallParser, text: str, cuts: list[int]) -> tuple[str, list[ToolCallDelta]]:
    content, calls = "", []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        c, d = parser.feed(text[a:b])
        content += c
        calls += d
    c, d = parser.finish()
    return content + c, calls + d


def test_named_schema_is_the_functions_parameters() -> None:
    schema = json.loads(forced_call_schema(TOOLS, "get_weather"))
    assert schema == WEATHER["function"]["parameters"]
    assert json.loads(forced_call_schema(TOOLS, "now")) == {"type": "object"}


def test_required_schema_accepts_calls_of_the_tools_only() -> None:
    schema = json.loads(forced_call_schema(TOOLS, None))
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}],
                        schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                {"name": "now", "parameters": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(forced_call_schema(TOOLS, None, parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, one)


@pytest.mark.parametrize("text", ['{"city": "Paris"}', '{ "city" : "S\\u00e3o \\"Paulo\\"" }'])
def test_named_call_streams_its_arguments_at_every_cut(text: str) -> None:
    for cut in range(1, len(text)):
        content, pieces = _stream(ForcedCallParser("get_weather"), text, [cut])
        assert content == ""
        assert pieces[0].id and pieces[0].id.startswith("call_") and pieces[0].name == "get_weather"
        assert all(p.id is None and p.name is None for p in pieces[1:])
        (call,) = whole_calls(pieces)
        assert call.arguments == text


ARRAY = ('[{"name": "get_weather", "parameters": {"city": "Par]is {x}"}}, '
         '{"name": "now", "parameters": {"tz": "UTC"}}]')


def test_required_calls_are_read_item_by_item_at_every_cut() -> None:
    for cut in range(1, len(ARRAY)):
        for cuts in ([cut], list(range(1, len(ARRAY))) if cut == 1 else [cut]):
            content, pieces = _stream(ForcedCallParser(None), ARRAY, cuts)
            assert content == ""
            assert [(p.index, p.name) for p in pieces] == [(0, "get_weather"), (1, "now")]
            assert [json.loads(p.arguments) for p in pieces] == [{"city": "Par]is {x}"}, {"tz": "UTC"}]
            assert len({p.id for p in pieces}) == 2


def test_a_required_output_cut_short_is_returned_as_content() -> None:
    text = ARRAY[:80]  # the second call is unfinished (max_tokens)
    content, pieces = _stream(ForcedCallParser(None), text, [30])
    assert [p.name for p in pieces] == ["get_weather"]
    assert content.startswith('{"name": "now"')


class _Reasoning:
    """Stands in for a reasoning parser: everything before "|" is thinking."""

    def __init__(self) -> None:
        self.seen = ""
        self.done = False

    def feed(self, text: str) -> tuple[str, str]:
        if self.done:
            return "", text
        self.seen += text
        if "|" in self.seen:
            self.done = True
            head, tail = self.seen.split("|", 1)
            return head, tail
        return "", ""

    def finish(self) -> tuple[str, str]:
        return ("" if self.done else self.seen), ""


def test_chat_output_chains_reasoning_then_calls() -> None:
    out = ChatOutput(_Reasoning(), ForcedCallParser("get_weather"))  # type: ignore[arg-type]
    first = out.feed("thinking|")
    assert (first.reasoning, first.content, first.calls) == ("thinking", "", [])
    second = out.feed('{"city": "Rome"}', finished=True)
    assert second.reasoning == "" and [c.name for c in second.calls] == ["get_weather"]
    assert out.called


def test_chat_output_without_parsers_passes_text_through() -> None:
    out = ChatOutput(None, None)
    parsed = out.feed("hello", finished=True)
    assert (parsed.content, parsed.reasoning, parsed.calls, out.called) == ("hello", "", [], False)


def _dicts(calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
    return [{"index": c.index, "id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


def test_whole_calls_joins_pieces_per_index() -> None:
    pieces = [ToolCallDelta(0, "call_a", "f", '{"x"'), ToolCallDelta(1, "call_b", "g", "{}"),
              ToolCallDelta(0, None, None, ": 1}")]
    assert _dicts(whole_calls(pieces)) == [{"index": 0, "id": "call_a", "name": "f", "arguments": '{"x": 1}'},
                                           {"index": 1, "id": "call_b", "name": "g", "arguments": "{}"}]
