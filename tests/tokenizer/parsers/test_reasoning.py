"""Reasoning parsers: whole-text split, streams cut at every character, and the chain into tool calls."""

from __future__ import annotations

import json

import pytest

from services.tokenizer.parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    detect_reasoning_parser,
    make_reasoning_parser,
    make_tool_parser,
)
from services.tokenizer.parsers.tool_calls import assemble_calls

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'

# (parser, thinking_enabled, model output, expected reasoning, expected content)
CASES: list[tuple[str, bool, str, str | None, str]] = [
    # deepseek-r1: the template opened <think>, the output starts inside the reasoning
    ("deepseek-r1", True, "Let me think.\n2+2 is 4.\n</think>\n\nThe answer is 4.", "Let me think.\n2+2 is 4.",
     "The answer is 4."),
    ("deepseek-r1", True, "<think>\nHmm.\n\nYes.\n</think>\n\nFour.", "Hmm.\n\nYes.", "Four."),
    ("deepseek-r1", True, "Cut off while still thinking <", "Cut off while still thinking <", ""),
    ("deepseek-r1", True, "\n</think>\n\nNo reasoning.", "", "No reasoning."),
    ("deepseek-r1", True, "a </think> b </think> c", "a", "b </think> c"),
    ("deepseek-r1", False, "The answer is 4.", None, "The answer is 4."),
    ("deepseek-r1", False, "<think>x</think>y", "x", "y"),
    # qwen3: reasoning only when the output opens it
    ("qwen3", True, "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.", "It is 4."),
    ("qwen3", True, "<think>\n\n</think>\n\nIt is 4.", "", "It is 4."),
    ("qwen3", True, "  It is 4. <think> is a tag", None, "  It is 4. <think> is a tag"),
    ("qwen3", True, "<thin", None, "<thin"),
    ("qwen3", True, f"<think>\nI should call a tool.\n{CALL}", "I should call a tool.", CALL),
    ("qwen3", True, f"<think>\nOk.\n</think>\n\n{CALL}", "Ok.", CALL),
    ("qwen3", False, "<think>x</think>y", None, "<think>x</think>y"),
]


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize(("name", "enabled", "text", "reasoning", "content"), CASES)
def test_parse(name: str, enabled: bool, text: str, reasoning: str | None, content: str) -> None:
    assert make_reasoning_parser(name, enabled).parse(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "enabled", "text", "reasoning", "content"), CASES)
def test_stream_cut_anywhere_matches_parse(name: str, enabled: bool, text: str, reasoning: str | None,
                                           content: str) -> None:
    cuts = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        assert _stream(make_reasoning_parser(name, enabled), pieces) == (reasoning or "", content), pieces


def test_stream_holds_back_only_tags_and_trailing_blanks() -> None:
    p = make_reasoning_parser("qwen3")
    assert p.feed("<th") == ("", "")
    assert p.feed("ink>\nStep one") == ("Step one", "")
    assert p.feed(".\n</thi") == (".", "")
    assert p.feed("nk>\n\nFin") == ("", "Fin")
    assert p.feed("al.") == ("", "al.")
    assert p.finish() == ("", "")


def test_chained_with_tool_calls_cut_anywhere() -> None:
    """What the wiring does: reasoning first, then tool calls on the content part."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    text = f"<think>\nThe user asks the time.\n</think>\n\nChecking.\n{CALL}"
    for k in range(len(text) + 1):
        reasoner, caller = make_reasoning_parser("qwen3"), make_tool_parser("hermes", tools)
        reasoning, content, deltas = "", "", []
        for piece in (text[:k], text[k:], None):
            r, c = reasoner.feed(piece) if piece is not None else reasoner.finish()
            reasoning += r
            out = caller.feed(c)
            content += out.content
            deltas += out.calls
            if piece is None:
                out = caller.finish()
                content += out.content
                deltas += out.calls
        calls = assemble_calls(deltas)
        assert (reasoning, content) == ("The user asks the time.", "Checking.\n")
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]


def test_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="reasoning_parser: unknown value 'o1'"):
        make_reasoning_parser("o1")


# Short but faithful excerpts of the real chat templates (history rendering and generation prompt)
QWEN3_TEMPLATE = (
    "{%- if reasoning_content %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}\n{%- endif %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}\n"
)
DEEPSEEK_R1_TEMPLATE = (
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + "
    "'<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)
QWQ_TEMPLATE = (
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}\n"
)
QWEN25_TEMPLATE = "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN3_TEMPLATE, "qwen3"),
        (DEEPSEEK_R1_TEMPLATE, "deepseek-r1"),
        (QWQ_TEMPLATE, "deepseek-r1"),
        (QWEN25_TEMPLATE, None),
        (None, None),
    ],
)
def test_detect_reasoning_parser(template: str | None, expected: str | None) -> None:
    assert detect_reasoning_parser(template) == expected
    if expected is not None:
        assert expected in REASONING_PARSERS
