"""Constrained decoding through the four real processes: JSON schema, regex and EBNF on /generate,
OpenAI response_format on chat and completions (streaming and not), and bad constraints as 400s
that name the field while other requests keep being served.

The default model has random weights, so its outputs are only as good as the grammar makes them:
every output that ends with "stop" must match its constraint; some may run into max_new_tokens.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import httpx
import jsonschema
import pytest

from tests.e2e.stack import Stack, running_stack

pytestmark = pytest.mark.e2e

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "email": {"type": "string", "pattern": "[a-z]{1,8}@[a-z]{1,8}\\.com"}},
            "required": ["id", "email"]},
        "active": {"type": "boolean"}},
     "required": ["user", "active"]},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "maxItems": 5}},
     "required": ["tags", "scores"]},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]},
        "kind": {"const": "shirt"}},
     "required": ["color", "size", "kind"]},
    {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -100, "maximum": 100},
        "y": {"type": "number", "minimum": 0, "maximum": 1}, "label": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["x", "y", "label"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{3}"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["sku", "qty"]},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {
        "matrix": {"type": "array", "maxItems": 3, "items": {
            "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["matrix", "ok", "note"]},
    {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "items": {"type": "array", "items": {"enum": ["tea", "cake", "pie"]}, "minItems": 1, "maxItems": 3},
            "total": {"type": "integer", "minimum": 0, "maximum": 500},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"]}},
            "required": ["items", "total", "address"]}},
     "required": ["order"]},
    {"type": "object", "properties": {
        "status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599},
        "message": {"type": "string", "maxLength": 16}},
     "required": ["status", "code"]},
    {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "string", "minLength": 1, "maxLength": 3},
        "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
     "required": ["a", "b", "c"]},
]
PROMPTS = ["Give me JSON:", "Output a record.", "{", "Describe the item as JSON", "data ="]

REGEXES = [
    r"[0-9]{3}-[a-z]{2,5}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}\.",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
    r"\d{4}-\d{2}-\d{2}",
]

# Recursive through "(" expr ")": the checker below must really descend.
ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""


def parse_arith(s: str) -> bool:
    """Recursive descent for ARITH_EBNF: True if s is exactly one expr."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] in "123456789":
            pos += 1
            if pos < len(s) and s[pos].isdigit():
                pos += 1
            return True
        return False

    def factor() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        return num()

    def chain(item, ops: str) -> bool:
        nonlocal pos
        if not item():
            return False
        while pos < len(s) and s[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(s)


def test_arith_checker() -> None:
    assert parse_arith("1+(2*(3-4))/56") and parse_arith("7")
    assert not parse_arith("1+") and not parse_arith("(1") and not parse_arith("01") and not parse_arith("1 + 2")


@pytest.fixture(scope="module")
def stack(model_dir: str):
    with running_stack(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack):
    from openai import OpenAI

    return OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none", max_retries=0, timeout=120)


def generate_all(stack: Stack, bodies: list[dict]) -> list[dict]:
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: stack.generate(b, timeout=180), bodies))


def test_json_schemas(stack: Stack) -> None:
    bodies = []
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        bodies.append({"text": PROMPTS[i % len(PROMPTS)], "sampling_params": {
            "json_schema": json.dumps(schema), "max_new_tokens": 256, "temperature": 0.8 + 0.05 * (i % 5),
            "seed": 1000 + i}})
    outs = generate_all(stack, bodies)
    stopped = 0
    for i, (_body, out) in enumerate(zip(bodies, outs)):
        reason = out["meta_info"]["finish_reason"]["type"]
        assert reason in ("stop", "length"), (i, out["meta_info"])
        if reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(out["text"]), SCHEMAS[i % len(SCHEMAS)])
    print(f"json_schema: {stopped}/50 finished with stop")
    assert stopped >= 45


def test_regexes(stack: Stack) -> None:
    bodies = [{"text": f"Answer {i}:", "sampling_params": {"regex": REGEXES[i % len(REGEXES)], "max_new_tokens": 64,
                                                           "temperature": 1.0, "seed": i}}
              for i in range(2 * len(REGEXES))]
    for i, out in enumerate(generate_all(stack, bodies)):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(REGEXES[i % len(REGEXES)], out["text"]), (REGEXES[i % len(REGEXES)], out["text"])


def test_ebnf_arithmetic(stack: Stack) -> None:
    bodies = [{"text": "Compute:", "sampling_params": {"ebnf": ARITH_EBNF, "max_new_tokens": 128,
                                                       "temperature": 0.9, "seed": 50 + i}} for i in range(8)]
    outs = generate_all(stack, bodies)
    stopped = [o["text"] for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert len(stopped) >= 6, [o["meta_info"]["finish_reason"] for o in outs]
    for text in stopped:
        assert parse_arith(text), text


def test_n_samples_each_match(stack: Stack) -> None:
    out = httpx.post(f"{stack.gateway_url}/generate", timeout=120, json={
        "text": "n:", "sampling_params": {"regex": REGEXES[0], "n": 3, "temperature": 1.0, "seed": 3,
                                          "max_new_tokens": 32}}).json()
    assert len(out) == 3 and len({o["text"] for o in out}) > 1
    for o in out:
        assert re.fullmatch(REGEXES[0], o["text"])


PERSON = SCHEMAS[0]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_response_format(client, stream: bool) -> None:
    model = client.models.list().data[0].id
    texts = []
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "who?"}],
                                          response_format=RESPONSE_FORMAT, max_tokens=256, temperature=0.9,
                                          seed=11, stream=stream)
    comp = client.completions.create(model=model, prompt="Person:", max_tokens=256, temperature=0.9, seed=12,
                                     stream=stream, extra_body={"response_format": RESPONSE_FORMAT})
    if stream:
        texts.append("".join(c.choices[0].delta.content or "" for c in chat if c.choices))
        texts.append("".join(c.choices[0].text for c in comp if c.choices))
    else:
        assert chat.choices[0].finish_reason == "stop" and comp.choices[0].finish_reason == "stop"
        texts += [chat.choices[0].message.content, comp.choices[0].text]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    obj = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "json"}],
                                         response_format={"type": "json_object"}, max_tokens=64, seed=13,
                                         stream=stream)
    text = "".join(c.choices[0].delta.content or "" for c in obj if c.choices) if stream \
        else obj.choices[0].message.content
    assert isinstance(json.loads(text), dict)


def test_bad_constraints_are_400s_naming_the_field(stack: Stack, client) -> None:
    import openai

    model = client.models.list().data[0].id
    long_body = {"text": "keep going", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True,
                                                           "temperature": 0}}
    with cf.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(stack.generate, long_body, 120)  # served all along, next to the failures
        for kind, text in (("json_schema", '{"type": "nope"}'), ("regex", "(ab"), ("ebnf", "root ::= (")):
            r = httpx.post(f"{stack.gateway_url}/generate", timeout=60,
                           json={"text": "x", "sampling_params": {kind: text, "max_new_tokens": 8}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["message"].startswith(f"sampling_params.{kind}: ") and kind in err["param"], err
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=model, prompt="x", max_tokens=8, extra_body={kind: text})
            assert e.value.body["param"] == kind, e.value.body  # type: ignore[index]  # APIError.body is typed object
        bad_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                     response_format=bad_format, max_tokens=8, stream=stream)
                list(out) if stream else None
            assert e.value.body["param"] == "response_format", e.value.body  # type: ignore[index]  # APIError.body is typed object
        done = busy.result(timeout=120)
    assert done["meta_info"]["finish_reason"]["type"] == "length" and done["meta_info"]["completion_tokens"] == 200


def test_grammar_metrics_exported(stack: Stack) -> None:
    text = httpx.get(f"http://127.0.0.1:{stack.ports['sched_metrics']}/metrics", timeout=10).text
    assert "sglang:num_grammar_queue_reqs" in text
    m = re.search(r"^sglang:grammar_compile_seconds_count\{[^}]*\} ([\d.e+]+)$", text, re.M)
    assert m and float(m.group(1)) > 0
