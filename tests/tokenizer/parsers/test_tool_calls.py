"""Tool-call parsers on real markup of each family: whole-text parse, and streams cut at every character.

The property that matters for streaming: however the text is cut into deltas, the concatenated content and
the reassembled calls equal the whole-text parse (and markup never shows up in the content).
"""

from __future__ import annotations

import json
import os
import random
import re
from typing import Any

import pytest

from services.tokenizer.parsers import (
    TOOL_PARSERS,
    ToolCallDelta,
    ToolCallParser,
    detect_reasoning_parser,
    detect_tool_parser,
    make_tool_parser,
)
from services.tokenizer.parsers.tool_calls import assemble_calls
from tests.real_tokenizers import REQUIRE_ENV, RealTokenizerUnavailable, real_tokenizer_dir

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                    "detailed": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "where": {"type": "object"},
                    "ratio": {"type": "number"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
]

Call = tuple[str, dict[str, Any]]
PARIS: Call = ("get_weather", {"city": "Paris", "unit": "celsius"})
TOKYO_TIME: Call = ("get_time", {"tz": "Asia/Tokyo"})
ID = re.compile(r"call_[0-9a-f]{24}")

DSV3_PARIS = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>'
)
DSV3_TOKYO = (
    '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"tz": "Asia/Tokyo"}\n```<｜tool▁call▁end｜>'
)

# (parser, model output, expected content, expected calls): real markup of each family
CASES: list[tuple[str, str, str, list[Call]]] = [
    # Hermes / Qwen2.5 / Qwen3: one JSON object per <tool_call> block
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "",
        [PARIS],
    ),
    (
        "qwen25",
        "Let me check both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>',
        "Let me check both.\n\n",
        [PARIS, TOKYO_TIME],
    ),
    (  # undeclared name: stays content, the declared call after it is still reported
        "hermes",
        '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>',
        '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>',
        [TOKYO_TIME],
    ),
    (  # malformed JSON: stays content
        "hermes",
        'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call> bye',
        'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call> bye',
        [],
    ),
    (  # half-written at the end of the stream: content, never lost
        "hermes",
        'Checking <tool_call>\n{"name": "get_weather", "argu',
        'Checking <tool_call>\n{"name": "get_weather", "argu',
        [],
    ),
    (  # the model stopped right after the JSON, without </tool_call>
        "hermes",
        'Checking\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n',
        "Checking\n",
        [TOKYO_TIME],
    ),
    (  # arguments written as a JSON string
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"Asia/Tokyo\\"}"}</tool_call>',
        "",
        [TOKYO_TIME],
    ),
    ("hermes", "The answer is 4. <tool_ca is not a tag", "The answer is 4. <tool_ca is not a tag", []),
    # Qwen3-Coder XML: values typed by the tool's schema
    (
        "qwen3_coder",
        "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
        "I'll look it up.\n",
        [PARIS],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\nCity\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n"
        "<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=where>\n{'lat': 40.7}\n</parameter>\n"
        "<parameter=ratio>\n0.5\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nAsia/Tokyo\n</parameter>\n</function>\n</tool_call>",
        "\n",  # content is verbatim: the blank between two blocks stays (the wiring may strip it)
        [
            (
                "get_weather",
                {"city": "New York\nCity", "days": 3, "detailed": True, "hours": [9, 12], "where": {"lat": 40.7},
                 "ratio": 0.5, "extra": "42"},
            ),
            TOKYO_TIME,
        ],
    ),
    (  # a value of the wrong type stays a string; a missing </parameter> is forgiven
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\nthree\n"
        "</parameter>\n</function>\n</tool_call>",
        "",
        [("get_weather", {"city": "Paris", "days": "three"})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
        [],
    ),
    (  # malformed: text outside the function
        "qwen3_coder",
        "<tool_call>\nget_weather(Paris)\n</tool_call>",
        "<tool_call>\nget_weather(Paris)\n</tool_call>",
        [],
    ),
    # Llama 3.x JSON
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
     [PARIS]),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}',
        "",
        [PARIS, TOKYO_TIME],
    ),
    (
        "llama3",
        'Sure. <|python_tag|>{"type": "function", "name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}',
        "Sure. ",
        [TOKYO_TIME],
    ),
    (  # a `;`-chain with an undeclared call is kept whole
        "llama3",
        '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}; {"name": "nope", "parameters": {}}',
        '{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}; {"name": "nope", "parameters": {}}',
        [],
    ),
    ("llama3", '<|python_tag|>{"name": "get_time", "parameters": {"tz": ', '<|python_tag|>{"name": "get_time", '
     '"parameters": {"tz": ', []),
    ("llama3", "{Hello} there", "{Hello} there", []),
    # Mistral: the v0.3 list, and the newer NAME[ARGS]{...}
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]',
        "",
        [PARIS, TOKYO_TIME],
    ),
    (
        "mistral",
        'Let me see.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "Asia/Tokyo"}',
        "Let me see.",
        [PARIS, TOKYO_TIME],
    ),
    ("mistral", '[TOOL_CALLS]launch[ARGS]{"x": 1}', '[TOOL_CALLS]launch[ARGS]{"x": 1}', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": }]', '[TOOL_CALLS] [{"name": "get_time", '
     '"arguments": {"tz": }]', []),
    # pythonic (Llama 3.2 / 4)
    (
        "pythonic",
        "[get_weather(city='Paris', unit='celsius'), get_time(tz=\"Asia/Tokyo\")]",
        "",
        [PARIS, TOKYO_TIME],
    ),
    (
        "pythonic",
        "Checking [1] first. <|python_start|>[get_weather(city='Paris', unit='celsius', days=2, detailed=True,"
        " hours=[9, 12], where={'lat': 1.5, 'n': None})]<|python_end|>",
        "Checking [1] first. ",
        [("get_weather", {"city": "Paris", "unit": "celsius", "days": 2, "detailed": True, "hours": [9, 12],
                          "where": {"lat": 1.5, "n": None}})],
    ),
    (  # nothing is evaluated: a non-literal value keeps the block as content
        "pythonic",
        "[get_weather(city=__import__('os').getcwd())]",
        "[get_weather(city=__import__('os').getcwd())]",
        [],
    ),
    ("pythonic", "[delete_all(really=True)]", "[delete_all(really=True)]", []),
    ("pythonic", "See [the docs](http://x) and a[i(1)].", "See [the docs](http://x) and a[i(1)].", []),
    ("pythonic", "[get_time(tz='Asia/", "[get_time(tz='Asia/", []),
    # DeepSeek V3
    (
        "deepseekv3",
        f"Checking.<｜tool▁calls▁begin｜>{DSV3_PARIS}\n{DSV3_TOKYO}<｜tool▁calls▁end｜>",
        "Checking.\n",
        [PARIS, TOKYO_TIME],
    ),
    (
        "deepseekv3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"tz\": Tokyo}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"tz\": Tokyo}\n```<｜tool▁call▁end｜>",
        [],
    ),
    ("deepseekv3", f"<｜tool▁calls▁begin｜>{DSV3_PARIS[:40]}", DSV3_PARIS[:40], []),
]

# The bare-call rule: the whole output is a call object (or a list of them), for every format
BARE_CASES: list[tuple[str, str, list[Call]]] = [
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "", [PARIS]),
    ('\n ```json\n{"name": "get_time", "parameters": {"tz": "Asia/Tokyo"}}\n```\n', "", [TOKYO_TIME]),
    (
        '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}]',
        "",
        [PARIS, TOKYO_TIME],
    ),
    # not a call: an undeclared tool, other keys, text after it, ordinary JSON, a list of numbers
    ('{"name": "send_email", "arguments": {"to": "x"}}', '{"name": "send_email", "arguments": {"to": "x"}}', []),
    ('{"name": "get_time", "arguments": {}, "note": 1}', '{"name": "get_time", "arguments": {}, "note": 1}', []),
    ('{"name": "get_time", "arguments": {}} is what I would call',
     '{"name": "get_time", "arguments": {}} is what I would call', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ("[1] Paris is the capital.", "[1] Paris is the capital.", []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ('{"name": "get_time", "arguments": {"tz": NaN}}', '{"name": "get_time", "arguments": {"tz": NaN}}', []),
]


def _calls(result_calls: list[Any]) -> list[Call]:
    return [(c.name, json.loads(c.arguments)) for c in result_calls]


def _stream(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        out = parser.feed(piece)
        content.append(out.content)
        deltas.extend(out.calls)
    out = parser.finish()
    content.append(out.content)
    deltas.extend(out.calls)
    return "".join(content), deltas


def _check_deltas(deltas: list[ToolCallDelta]) -> None:
    """OpenAI's streamed shape: a call's first delta has id and name, indexes count up from 0."""
    seen: set[int] = set()
    for d in deltas:
        if d.index not in seen:
            assert d.index == len(seen)
            assert ID.fullmatch(d.id or "") and d.name
            seen.add(d.index)
        else:
            assert d.id is None and d.name is None


def assert_split_invariant(name: str, text: str) -> None:
    """Cut text at every position (and into single characters): the same content and calls each time."""
    whole = make_tool_parser(name, TOOLS).parse(text)
    cuts = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        content, deltas = _stream(make_tool_parser(name, TOOLS), pieces)
        _check_deltas(deltas)
        assert content == whole.content, pieces
        assert _calls(assemble_calls(deltas)) == _calls(whole.calls), pieces


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parse(name: str, text: str, content: str, calls: list[Call]) -> None:
    result = make_tool_parser(name, TOOLS).parse(text)
    assert result.content == content
    assert _calls(result.calls) == calls
    ids = [c.id for c in result.calls]
    assert all(ID.fullmatch(i) for i in ids) and len(set(ids)) == len(ids)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_stream_cut_anywhere_matches_parse(name: str, text: str, content: str, calls: list[Call]) -> None:
    assert_split_invariant(name, text)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize(("text", "content", "calls"), BARE_CASES)
def test_bare_call_rule(name: str, text: str, content: str, calls: list[Call]) -> None:
    if name == "llama3" and text.endswith("I would call"):
        # not bare, but Llama 3's own format: a call object opening the output is a call whatever follows
        content, calls = " is what I would call", [("get_time", {})]
    result = make_tool_parser(name, TOOLS).parse(text)
    assert _calls(result.calls) == calls
    assert result.content == content
    assert_split_invariant(name, text)


def test_stream_holds_back_only_what_may_be_markup() -> None:
    p = make_tool_parser("hermes", TOOLS)
    assert p.feed("Let me check. <tool") == ("Let me check. ", [])
    assert p.feed("_call>\n") == ("", [])
    assert p.feed('{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_') == ("", [])
    out = p.feed("call>\nDone")
    assert out.content == "\nDone" and [(d.name, json.loads(d.arguments)) for d in out.calls] == [TOKYO_TIME]
    assert p.finish() == ("", [])


def test_stream_releases_text_that_cannot_be_a_bare_call() -> None:
    p = make_tool_parser("hermes", TOOLS)
    assert p.feed("  ") == ("", [])  # blanks at the start: a bare call may still follow
    assert p.feed("{") == ("", [])
    assert p.feed("Hi}") == ("  {Hi}", [])
    q = make_tool_parser("hermes", TOOLS)
    assert q.feed('{"name": "get_time", "arguments": {}}') == ("", [])  # could be the whole output
    assert q.feed(" and more") == ('{"name": "get_time", "arguments": {}} and more', [])


def test_call_indexes_and_ids_across_feeds() -> None:
    p = make_tool_parser("hermes", TOOLS)
    block = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    first, second = p.feed(block).calls, p.feed("\n" + block).calls
    assert [d.index for d in first + second] == [0, 1]
    assert first[0].id != second[0].id


def test_parse_leaves_the_stream_alone() -> None:
    p = make_tool_parser("hermes", TOOLS)
    p.feed("<tool_call>")
    assert p.parse("plain").content == "plain"
    out = p.feed('{"name": "get_time", "arguments": {}}</tool_call>')
    assert [d.name for d in out.calls] == ["get_time"]


def test_no_tools_passes_text_through() -> None:
    p = make_tool_parser("hermes", [])
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert p.feed(text) == (text, [])


def test_unknown_parser_and_bad_tools_are_named() -> None:
    with pytest.raises(ValueError, match="tool_call_parser: unknown value 'gpt9'"):
        make_tool_parser("gpt9", TOOLS)
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.name"):
        make_tool_parser("hermes", [TOOLS[0], {"type": "function", "function": {}}])


# Short but faithful excerpts of the real chat templates (the lines that write tool calls)
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
QWEN3_CODER_TEMPLATE = (
    '{{- "\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n'
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n"
    '</parameter>\\n</function>\\n</tool_call>" }}\n'
    "{%- for tool_call in message.tool_calls %}\n"
    "    {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}\n"
    "    {%- for args_name, args_value in tool_call.arguments|items %}\n"
    "        {{- '<parameter=' + args_name + '>\\n' }}\n"
)
LLAMA31_TEMPLATE = (
    '{%- if tools is not none %}\n    {{- "Environment: ipython\\n" }}\n{%- endif %}\n'
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}. ' }}\n"
    "{%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
    "    {{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}\n"
)
LLAMA32_TEMPLATE = (
    '{%- if tools is not none %}\n    {{- "Environment: ipython\\n" }}\n{%- endif %}\n'
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}\n{{- '\"parameters\": ' }}\n"
    "{{- tool_call.arguments | tojson }}\n"
)
LLAMA4_PYTHONIC_TEMPLATE = (
    '{{- "Tool Call Syntax: You can call tools using the following syntax:\\n"\n'
    '    "[func_name1(params_name1=params_value1, params_name2=params_value2, ...), ...]\\n" }}\n'
    "{{- \"<|header_start|>ipython<|header_end|>\\n\\n\" }}\n"
)
MISTRAL_TEMPLATE = (
    '{{- "[AVAILABLE_TOOLS] [" }}\n'
    '{%- elif message.tool_calls is defined and message.tool_calls is not none %}\n'
    '    {{- "[TOOL_CALLS] [" }}\n    {%- for tool_call in message.tool_calls %}\n'
)
DEEPSEEK_V3_TEMPLATE = (
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}\n"
)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN25_TEMPLATE, "hermes"),
        (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
        (LLAMA31_TEMPLATE, "llama3"),
        (LLAMA32_TEMPLATE, "llama3"),
        (LLAMA4_PYTHONIC_TEMPLATE, "pythonic"),
        (MISTRAL_TEMPLATE, "mistral"),
        (DEEPSEEK_V3_TEMPLATE, "deepseekv3"),
        (SMOLLM2_TEMPLATE, None),
        (None, None),
    ],
)
def test_detect_tool_parser(template: str | None, expected: str | None) -> None:
    assert detect_tool_parser(template) == expected
    if expected is not None:
        assert expected in TOOL_PARSERS


def test_random_mixes_cut_at_random_match_parse() -> None:
    """Seeded fuzz: pieces of real markup, stray marker prefixes and prose glued together and cut anywhere."""
    rng = random.Random(20250125)
    pieces = [t for _, t, _, _ in CASES] + [t for t, _, _ in BARE_CASES] + [
        "Hello ", "\n", " ", "[", "{", "<", "`", ";", "]", "}", "```json\n", "```", "<tool_call>", "</tool_call>",
        "[TOOL_CALLS]", "<|python_tag|>", "<|python_start|>", "<|python_end|>", "[ARGS]", "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁end｜>", '{"name": "get_time", "arguments": {}}', "get_time(tz='x')", "get_time[ARGS]",
    ]
    for _ in range(1500):
        name = rng.choice(sorted(TOOL_PARSERS))
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 6)))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        whole = make_tool_parser(name, TOOLS).parse(text)
        content, deltas = _stream(make_tool_parser(name, TOOLS), chunks)
        assert (content, _calls(assemble_calls(deltas))) == (whole.content, _calls(whole.calls)), (name, chunks)


def test_detect_on_the_real_qwen3_template() -> None:
    """The whole Qwen3 chat template as shipped (tokenizer_config.json): hermes calls, qwen3 reasoning."""
    try:
        model = real_tokenizer_dir("qwen3")
    except RealTokenizerUnavailable as e:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"real tokenizer qwen3 unavailable: {e}")
        pytest.skip(f"real tokenizer qwen3 unavailable: {e}")
    template = json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    assert (detect_tool_parser(template), detect_reasoning_parser(template)) == ("hermes", "qwen3")
