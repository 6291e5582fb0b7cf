"""logit_bias and stop_regex through the four real processes (gateway -> tokenizer -> scheduler ->
detokenizer): they act on the output, and bad values are a 400 naming the field."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from ringserve.text_tokenizer import TextTokenizer
from tests.e2e.stack import Stack, running_stack, sse_events

pytestmark = pytest.mark.e2e

PROMPT = "The scheduler decides every finish, and the detokenizer"


@pytest.fixture(scope="module")
def stack(model_dir: str) -> Iterator[Stack]:
    with running_stack(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir: str) -> TextTokenizer:
    return TextTokenizer.from_model(model_dir)


def forced_id(tok: TextTokenizer) -> int:
    """A plain, non-EOS, non-special token: the first id of an ordinary word."""
    token = tok.encode(" apple", add_special_tokens=False)[0]
    assert token not in tok.eos_token_ids
    return token


def completion(stack: Stack, **body: object) -> httpx.Response:
    return httpx.post(f"{stack.gateway_url}/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 8, **body}, timeout=60)


def test_logit_bias_100_makes_every_output_token_that_token(stack: Stack, tok: TextTokenizer) -> None:
    token = forced_id(tok)
    for temperature in (0.0, 1.0):  # greedy argmax and a draw both see the bias
        r = completion(stack, temperature=temperature, logit_bias={str(token): 100}, ignore_eos=True)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == tok.decode([token] * 8) and choice["finish_reason"] == "length"
    # The native API takes the same field and shows the ids.
    out = stack.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                              "logit_bias": {str(token): 100}}})
    assert out["output_ids"] == [token] * 6
    # -100 bans: the token greedy would pick first never comes.
    base = stack.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    first = base["output_ids"][0]
    banned = stack.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                 "logit_bias": {str(first): -100}}})
    assert first not in banned["output_ids"]


def test_stop_regex_ends_the_request_with_the_text_cut_at_the_match(stack: Stack) -> None:
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = stack.generate({"text": PROMPT, "sampling_params": sp})["text"]
    piece = full[len(full) // 2: len(full) // 2 + 2]
    assert piece.strip(), full
    pattern = re.escape(piece[0]) + "."  # its first character and whatever follows it
    start = re.search(pattern, full)
    assert start is not None
    out = stack.generate({"text": PROMPT, "sampling_params": {**sp, "stop_regex": pattern}})
    assert out["text"] == full[:start.start()]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    kept = stack.generate({"text": PROMPT, "sampling_params": {**sp, "stop_regex": [pattern], "no_stop_trim": True}})
    assert kept["text"] == full[:start.end()]
    # OpenAI completions, streamed and not: the same text, finish_reason "stop".
    body = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "stop_regex": pattern}
    r = completion(stack, **body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == full[:start.start()]
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", f"{stack.gateway_url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, **body, "stream": True}) as s:
        events = [e for e in sse_events(s) if isinstance(e, dict)]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == full[:start.start()]


@pytest.mark.parametrize("body,param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"stop_regex": "("}, "stop_regex[0]"),
    ({"stop_regex": ["ok", "x*"]}, "stop_regex[1]"),
    ({"stop_regex": "(a+)+b"}, "stop_regex[0]"),
])
def test_bad_values_are_400_naming_the_field(stack: Stack, body: dict, param: str) -> None:
    r = completion(stack, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    native = httpx.post(f"{stack.gateway_url}/generate", json={"text": PROMPT, "sampling_params": body}, timeout=60)
    assert native.status_code == 400, native.text
