"""The official openai client against a real gateway process over the fake tokenizer."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.gateway.fake_tokenizer import MODEL, FakeTokenizer

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def test_completion_plain(client: openai.OpenAI, fake: FakeTokenizer) -> None:
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, seed=3, temperature=0.5, top_p=0.9,
                                  frequency_penalty=0.1, presence_penalty=0.2, user="u1",
                                  extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.1, "min_tokens": 1})
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 1
    assert r.usage.prompt_tokens_details.cached_tokens == 1
    sp = fake.servicer.calls[-1].sampling_params
    assert (sp.max_new_tokens, sp.seed, sp.ignore_eos, sp.top_k, sp.min_new_tokens) == (5, 3, True, 5, 1)
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)


def test_completion_stream_equals_plain(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=["a b", "c"], max_tokens=5, n=2, stop=[" the"])
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes.setdefault(ch.index, []).append(ch.finish_reason)
    assert {c.index: c.text for c in full.choices} == texts
    assert len(full.choices) == 4 and all(len(v) == 1 for v in finishes.values()) and len(finishes) == 4
    assert {c.finish_reason for c in full.choices} == {"stop", "length"}
    last = chunks[-1]
    assert last.choices == [] and last.usage.total_tokens == full.usage.total_tokens
    assert full.usage.prompt_tokens == 3  # once per prompt, not per sample


def test_completion_token_prompts_echo_logprobs(client: openai.OpenAI, fake: FakeTokenizer) -> None:
    # Echo with logprobs scores the prompt too, as lm-eval's loglikelihood expects: prompt tokens
    # first (the first one null), then the output's, offsets across the whole echoed text.
    kw: dict[str, Any] = dict(model=MODEL, prompt=[[5, 6], [7]], max_tokens=3, echo=True, logprobs=2)
    r = client.completions.create(**kw)
    assert fake.servicer.calls[-1].logprob_start_len == 0
    assert r.choices[0].text.startswith("<5><6>") and r.choices[1].text.startswith("<7>")
    lp = r.choices[0].logprobs
    assert lp.tokens[:2] == ["<5>", "<6>"] and len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1] == -0.25 and len(lp.top_logprobs[1]) == 2 and len(lp.top_logprobs[2]) == 2
    assert lp.text_offset[:3] == [0, 3, len("<5><6>")]
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].index == 0]
    assert sum((x.token_logprobs for x in streamed), []) == lp.token_logprobs
    assert sum((x.text_offset for x in streamed), []) == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=3, logprobs=2)
    assert not fake.servicer.calls[-1].HasField("logprob_start_len") and len(plain.choices[0].logprobs.tokens) == 3


def test_chat_plain_and_stream(client: openai.OpenAI, fake: FakeTokenizer) -> None:
    msgs: list[ChatCompletionMessageParam] = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4, logprobs=True,
                                          top_logprobs=2)
    assert fake.servicer.calls[-1].chat.messages[1].content == "hello there"
    ch = full.choices[0]
    assert ch.message.role == "assistant" and ch.finish_reason == "length"
    assert len(ch.logprobs.content) == 4 and len(ch.logprobs.content[0].top_logprobs) == 2
    assert ch.logprobs.content[0].bytes == list(ch.logprobs.content[0].token.encode())
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ch.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_n_and_eos(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "EOS"}], n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "stop" for c in r.choices)
    assert len({c.message.content for c in r.choices}) == 3


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


@pytest.mark.parametrize("prompt,exc,param", [
    ("ERR INVALID_ARGUMENT sampling_params.max_new_tokens: exceeds context", openai.BadRequestError, "max_tokens"),
    ("ERR RESOURCE_EXHAUSTED queue full", openai.RateLimitError, None),
    ("ERR UNAVAILABLE no scheduler", openai.InternalServerError, None),
    ("ERR DEADLINE_EXCEEDED slow", openai.InternalServerError, None),
    ("ERR NOT_FOUND no such model", openai.NotFoundError, None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_backend_errors(client: openai.OpenAI, prompt: str, exc: type[openai.APIStatusError], param: str | None,
                        stream: bool) -> None:
    with pytest.raises(exc) as info:
        r = client.completions.create(model=MODEL, prompt=prompt, stream=stream)
        list(r) if stream else None
    assert info.value.body["param"] == param if isinstance(info.value.body, dict) else True
    if exc in (openai.RateLimitError,) or "UNAVAILABLE" in prompt:
        assert info.value.response.headers.get("retry-after") == "1"
    if "UNAVAILABLE" in prompt:
        assert info.value.status_code == 503


def test_request_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", best_of=2)
    assert e.value.body["param"] == "best_of"  # type: ignore[index]  # APIError.body is typed object
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature="hot")  # type: ignore[call-overload]
    assert e.value.body["param"] == "temperature"  # type: ignore[index]  # APIError.body is typed object
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.APIStatusError) as aborted:  # a clean abort is an error, never a finish_reason
        client.completions.create(model=MODEL, prompt="ABORT")
    assert aborted.value.status_code == 499


def test_mid_stream_error_is_an_event(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, stream=True,
                                            messages=[{"role": "user", "content": "MIDERR UNAVAILABLE gone"}])
    got = []
    with pytest.raises(openai.APIError) as e:
        for c in stream:
            got.append(c)
    # Two tokens went out before the error (in one or two chunks: the gateway merges what is ready).
    assert "".join(c.choices[0].delta.content or "" for c in got) == "Hello world"
    assert "gone" in e.value.message


def test_auth(gateway: str) -> None:
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=gateway + "/v1", api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_echo_offsets_end_where_the_echoed_text_does() -> None:
    """A text prompt's BOS is a logprobs token but not echoed text: the prompt's offsets are aligned
    to the text's end, the BOS at 0, and the output's follow the text."""
    from gateway.convert import echo_logprobs
    from ringserve.v1 import common_pb2

    def lps(*tokens: str) -> list:
        return [common_pb2.TokenLogprob(token=t, logprob=-1.0) for t in tokens]
    out = echo_logprobs(lps("<s>", "Hel", "lo", " wor", "ld"), lps("!", "?"), len("Hello world"))
    assert out["text_offset"] == [0, 0, 3, 5, 9, 11, 12]
    assert out["tokens"] == ["<s>", "Hel", "lo", " wor", "ld", "!", "?"]


def test_chat_tools_reach_the_tokenizer(client: openai.OpenAI, fake: FakeTokenizer) -> None:
    """The gateway only reshapes: tools, tool_choice, the history's calls and template kwargs arrive as sent."""
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool: Any = {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": params}}
    msgs: list[Any] = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    client.chat.completions.create(model=MODEL, messages=msgs, tools=[tool],  # type: ignore[list-item]
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                   parallel_tool_calls=False, max_tokens=2,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                               "separate_reasoning": False})
    chat = fake.servicer.calls[-1].chat
    assert [(t.name, json.loads(t.parameters_json)) for t in chat.tools] == [
        ("get_weather", tool["function"]["parameters"])]  # type: ignore[index]
    assert chat.tool_choice.function == "get_weather" and not chat.parallel_tool_calls
    assert [(c.id, c.name, c.arguments) for c in chat.messages[1].tool_calls] == [
        ("call_1", "get_weather", '{"city": "Oslo"}')]
    assert chat.messages[2].tool_call_id == "call_1"
    assert json.loads(chat.chat_template_kwargs_json) == {"enable_thinking": False}
    assert chat.HasField("separate_reasoning") and not chat.separate_reasoning


def test_unsupported_fields_are_refused_and_unknown_ones_ignored(client: openai.OpenAI) -> None:
    for field, value in [("priority", 5), ("use_beam_search", True), ("structured_outputs", {"regex": "a"})]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field  # type: ignore[index]  # APIError.body is typed object
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={field: value})
    ok = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                        extra_body={"use_beam_search": False, "no_api_has_this": [1]})
    assert ok.choices[0].finish_reason == "length"
