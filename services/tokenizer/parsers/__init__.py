"""Parsing a model's output text for the chat API: reasoning split from the answer, tool calls taken out of it.

Plain Python (no gRPC, no torch). Per sample the wiring chains them: the reasoning parser first
(reasoning.py), then the tool-call parser (tool_calls.py, tool_formats.py) on its content part.
"""

from .reasoning import (
    REASONING_PARSERS,
    ReasoningDeltas,
    ReasoningParser,
    ReasoningResult,
    detect_reasoning_parser,
    make_reasoning_parser,
)
from .tool_calls import ParseResult, ToolCall, ToolCallDelta, ToolCallParser, ToolDeltas
from .tool_formats import DEFAULT_TOOL_PARSER, TOOL_PARSERS, detect_tool_parser, make_tool_parser

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParseResult",
    "ReasoningDeltas",
    "ReasoningParser",
    "ReasoningResult",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolDeltas",
    "detect_reasoning_parser",
    "detect_tool_parser",
    "make_reasoning_parser",
    "make_tool_parser",
]
