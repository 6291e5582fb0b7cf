"""The torch-free tokenizer agrees with transformers on encode, decode and the chat template."""

from __future__ import annotations

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
