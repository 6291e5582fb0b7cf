"""OpenAI response_format -> sampling_params.json_schema (chat and completions), the native
/generate passing json_schema / regex / ebnf through, and errors naming the right field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.convert import JSON_OBJECT_SCHEMA, OPENAI_PARAMS, openai_param_map, sampling_from_openai
from gateway.errors import GatewayError
from gateway.protocol import ChatCompletionRequest
from tests.gateway.fake_tokenizer import MODEL, FakeTokenizer

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
SCHEMA: dict[str, object] = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name"]}


def test_chat_json_schema(client: openai.OpenAI, fake: FakeTokenizer) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "length"
    sp = fake.servicer.calls[-1].sampling_params
    assert sp.HasField("json_schema") and json.loads(sp.json_schema) == SCHEMA
    assert not sp.HasField("regex") and not sp.HasField("ebnf")


def test_chat_json_object_and_text(client: openai.OpenAI, fake: FakeTokenizer) -> None:
    client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=2,
                                   response_format={"type": "json_object"})
    assert fake.servicer.calls[-1].sampling_params.json_schema == JSON_OBJECT_SCHEMA
    client.chat.completions.create(model=MODEL, messages=MSG, max_completion_tokens=2,
                                   response_format={"type": "text"})
    assert not fake.servicer.calls[-1].sampling_params.HasField("json_schema")


def test_completions_response_format_stream(client: openai.OpenAI, fake: FakeTokenizer) -> None:
    """completions take response_format as an extra (SGLang / vLLM accept it there too)."""
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}))
    assert chunks and json.loads(fake.servicer.calls[-1].sampling_params.json_schema) == SCHEMA


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema"}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}, "response_format.json_schema.schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_bad_response_format_is_400_naming_it(http: httpx.Client, fake: FakeTokenizer, fmt: dict, param: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not fake.servicer.calls  # nothing reached the tokenizer


def test_response_format_with_another_constraint_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "regex": "a+",
                                           "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "regex" in r.json()["error"]["message"]


def test_rejected_schema_is_blamed_on_response_format(client: openai.OpenAI) -> None:
    """The scheduler's INVALID_ARGUMENT names sampling_params.json_schema; the client sent response_format."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content":
                                    "ERR INVALID_ARGUMENT sampling_params.json_schema: Unsupported type \"nope\""}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert e.value.body["param"] == "response_format"  # type: ignore[index]  # APIError.body is typed object
    assert "Unsupported type" in e.value.body["message"]  # type: ignore[index]  # APIError.body is typed object
    # The same error for a raw json_schema extra is blamed on json_schema.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="ERR INVALID_ARGUMENT sampling_params.json_schema: bad",
                                  extra_body={"json_schema": "{}"})
    assert e.value.body["param"] == "json_schema"  # type: ignore[index]  # APIError.body is typed object


def test_native_generate_passes_constraints(http: httpx.Client, fake: FakeTokenizer) -> None:
    for key, value in (("json_schema", json.dumps(SCHEMA)), ("regex", r"\d{3}"), ("ebnf", 'root ::= "a"')):
        r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, key: value}})
        assert r.status_code == 200, r.text
        sp = fake.servicer.calls[-1].sampling_params
        assert getattr(sp, key) == value
        assert [f for f in ("json_schema", "regex", "ebnf") if sp.HasField(f)] == [key]


def test_conversion_units() -> None:
    req = ChatCompletionRequest(messages=MSG, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": False}})
    assert json.loads(sampling_from_openai(req, None).json_schema) == SCHEMA
    assert openai_param_map(OPENAI_PARAMS, req)["sampling_params.json_schema"] == "response_format"
    plain = ChatCompletionRequest(messages=MSG)
    assert openai_param_map(OPENAI_PARAMS, plain) is OPENAI_PARAMS
    assert not sampling_from_openai(plain, None).HasField("json_schema")
    with pytest.raises(GatewayError):
        sampling_from_openai(ChatCompletionRequest(messages=MSG, ebnf="root ::= x",
                                                   response_format={"type": "json_object"}), None)
