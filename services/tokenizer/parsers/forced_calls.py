"""Forced tool calls: the constraint that makes the model write a call, and the parser that reads it.

`tool_choice: "required"` or a named function must return a valid call even from a model that would
not write one, so decoding is constrained by a JSON schema built from the tools (the scheduler's
grammar backend enforces it). The two halves of that contract live here:

- a named function F: the output is F's arguments object itself (schema: F's parameters), so the
  call's id and name are known before the first token and each text delta is an argument fragment;
- "required": the output is a JSON array of `{"name": ..., "parameters": {...}}`, one item per call
  (`anyOf` the tools; at most one item when parallel_tool_calls is false), read item by item.

This is vLLM's shape for both; a model's own markup is not needed because the grammar writes the call.
"""

from __future__ import annotations

import json
from typing import Any

from .tool_calls import ToolCallDelta, new_call_id

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else ANY_OBJECT


def forced_call_schema(tools: list[dict[str, Any]], function: str | None, parallel: bool = True) -> str:
    """The JSON schema (text) the output must match: `function`'s parameters, or with None
    ("required") an array of calls of any of `tools` (OpenAI's tool dicts)."""
    if function is not None:
        tool = next(t for t in tools if t["function"]["name"] == function)
        return json.dumps(_parameters(tool), separators=(",", ":"))
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "const": t["function"]["name"]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema, separators=(",", ":"))


class ForcedCallParser:
    """Streams the calls out of a forced output. feed(text) -> (content, calls), finish() likewise.

    Nothing of a forced output is content, except what cannot be read as a call at the end (an output
    cut by max_tokens): it is returned as content, so no text is lost."""

    def __init__(self, function: str | None) -> None:
        self.function = function
        self.started = False
        # "required": an incremental scan of the array, enough to find where each item ends.
        self.buf = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.item_start = -1
        self.consumed = 0  # buf[:consumed] became calls
        self.count = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.function is not None:
            return "", self._feed_arguments(text)
        self.buf += text
        return "", self._scan()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.function is not None:
            return "", []
        rest = self.buf[self.consumed:].strip().removeprefix(",").strip()  # after the last call read
        # A complete array leaves only its closing bracket; anything else is an unfinished call.
        return ("" if rest in ("", "]") else rest), []

    def _feed_arguments(self, text: str) -> list[ToolCallDelta]:
        if not self.started:
            if not text:
                return []
            self.started = True
            return [ToolCallDelta(index=0, id=new_call_id(), name=self.function, arguments=text)]
        return [ToolCallDelta(index=0, id=None, name=None, arguments=text)] if text else []

    def _scan(self) -> list[ToolCallDelta]:
        calls: list[ToolCallDelta] = []
        buf = self.buf
        for i in range(self.pos, len(buf)):
            ch = buf[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.item_start = i
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}" and self.item_start >= 0:
                    call = self._item(buf[self.item_start:i + 1])
                    if call is not None:
                        calls.append(call)
                        self.consumed = i + 1
                    self.item_start = -1
        self.pos = len(buf)
        return calls

    def _item(self, text: str) -> ToolCallDelta | None:
        try:
            item = json.loads(text)
        except ValueError:
            return None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        call = ToolCallDelta(index=self.count, id=new_call_id(), name=item["name"], arguments=args)
        self.count += 1
        return call
