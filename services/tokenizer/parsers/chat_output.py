"""One chat sample's output, split as it streams into reasoning, content and tool calls.

The reasoning parser sees the text first (thinking comes before the answer); what it calls content
goes on to the tool-call parser, which keeps call markup out of the content. Either may be absent.
A non-streamed sample goes through the same path in one piece, and `whole_calls` turns its call
pieces into whole calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .reasoning import ReasoningParser
from .tool_calls import ToolCallDelta, assemble_calls


class CallParser(Protocol):
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]: ...
    def finish(self) -> tuple[str, list[ToolCallDelta]]: ...


@dataclass
class Parsed:
    """What one piece of output turned into."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, calls: CallParser | None) -> None:
        self.reasoning = reasoning
        self.calls = calls
        self.called = False  # some call was returned: the sample finishes with "tool_calls"

    def feed(self, text: str, finished: bool = False) -> Parsed:
        """The sample's next text; with `finished`, also flush what the parsers held back."""
        out = Parsed()
        content = self._reason(out, text, finished)
        if self.calls is None:
            out.content = content
            return out
        out.content, out.calls = self.calls.feed(content) if content else ("", [])
        if finished:
            tail, calls = self.calls.finish()
            out.content += tail
            out.calls += calls
        self.called = self.called or bool(out.calls)
        return out

    def _reason(self, out: Parsed, text: str, finished: bool) -> str:
        if self.reasoning is None:
            return text
        out.reasoning, content = self.reasoning.feed(text) if text else ("", "")
        if finished:
            reasoning, tail = self.reasoning.finish()
            out.reasoning += reasoning
            content += tail
        return content


def whole_calls(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Streamed pieces -> one piece per call holding all of it (a non-streamed response's calls)."""
    return [ToolCallDelta(index=i, id=c.id, name=c.name, arguments=c.arguments)
            for i, c in enumerate(assemble_calls(pieces))]
