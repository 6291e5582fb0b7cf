"""The torch-free tokenizer agrees with transformers on encode, decode and the chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ringserve.text_tokenizer import ChatTemplateError, TextTokenizer

TEXTS = ["Hello world", "你好，世界！", "emoji 👨‍👩‍👧 and e\u0301", "def f(x):\n    return x"]


@pytest.fixture(scope="module")
def pair(model_dir: str):
    from transformers import AutoTokenizer

    return TextTokenizer.from_model(model_dir), AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text: str) -> None:
    ours, hf = pair
    ids = ours.encode(text)
    assert ids == hf(text).input_ids
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_chat_template_matches_transformers(pair) -> None:
    ours, hf = pair
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "你好"}]
    assert ours.encode_chat(msgs) == list(hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                                          ["input_ids"])


def test_template_errors_are_chat_template_errors(model_dir: str) -> None:
    tok = TextTokenizer.from_model(model_dir)
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(ChatTemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


TOOLS_TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chat_templates" / "chatml_tools.jinja"
TOOL: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
]


def test_tools_and_template_kwargs_render_as_transformers_does(model_dir: str) -> None:
    """--chat-template (a file), `tools` and extra template variables, against transformers' own rendering."""
    from transformers import AutoTokenizer

    ours = TextTokenizer.from_model(model_dir, str(TOOLS_TEMPLATE))
    hf = AutoTokenizer.from_pretrained(model_dir)
    template = TOOLS_TEMPLATE.read_text()
    want = hf.apply_chat_template(HISTORY, tools=[TOOL], chat_template=template, add_generation_prompt=True,
                                  tokenize=False)
    got = ours.apply_chat_template(HISTORY, tools=[TOOL])
    assert got == want
    assert '"name": "get_weather"' in got and "<tool_response>\ncold" in got
    assert ours.apply_chat_template(HISTORY[:1]) == hf.apply_chat_template(
        HISTORY[:1], chat_template=template, add_generation_prompt=True, tokenize=False)
    flag = TextTokenizer.from_model(model_dir, "{{ 'on' if enable_thinking else 'off' }}")
    assert flag.apply_chat_template(HISTORY, template_kwargs={"enable_thinking": True}) == "on"
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs"):
        ours.apply_chat_template(HISTORY, template_kwargs={"tools": []})


def test_chat_template_override_inline_or_missing_file(model_dir: str) -> None:
    assert TextTokenizer.from_model(model_dir, "{{ messages[0].content }}!").apply_chat_template(HISTORY) \
        == "Weather in Oslo?!"
    with pytest.raises(ValueError, match="--chat-template"):
        TextTokenizer.from_model(model_dir, "/no/such/template.jinja")
