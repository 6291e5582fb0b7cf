"""The xgrammar backend: errors name the request field; each kind compiles; the vocabulary fits the model."""

from __future__ import annotations

import json

import pytest

from services.scheduler.grammar import GrammarError, constraint_of, field_of, load_backend


@pytest.mark.parametrize("kind,text,says", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", '{"type": "nope"}', 'Unsupported type "nope"'),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/missing"}}}', ""),
    ("regex", "(ab", "parenthesis"),
    ("regex", "[z-a]", ""),
    ("ebnf", "root ::= missing_rule", 'Rule "missing_rule" is not defined'),
    ("ebnf", 'root ::= "a" | ', "EBNF parser error"),
    ("ebnf", 'start ::= "a"', ""),  # no root rule
])
def test_invalid_constraints_name_their_field(backend, kind: str, text: str, says: str) -> None:
    with pytest.raises(GrammarError) as e:
        backend.compile(kind, text)
    assert e.value.field == f"sampling_params.{kind}"
    assert str(e.value).startswith(f"sampling_params.{kind}: ")
    assert says in e.value.message
    # The C++ log prefix ("[12:01:33] /project/cpp/x.cc:94: ") never reaches a client.
    assert ".cc:" not in e.value.message and len(e.value.message) < 320


@pytest.mark.parametrize("kind,text,good,bad", [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
     '{"a": 12}', '{"b": 1}'),
    ("regex", r"[0-9]{2}-x", "42-x", "4-x"),
    ("ebnf", 'root ::= "yes" | "no"', "no", "nah"),
])
def test_each_kind_compiles_and_matches(backend, kind: str, text: str, good: str, bad: str) -> None:
    compiled = backend.compile(kind, text)
    ok, ko = compiled.matcher(), compiled.matcher()  # independent matchers from one compiled grammar
    assert ok.m.accept_string(good) and ok.m.is_completed()
    assert not ko.m.accept_string(bad) or not ko.m.is_completed()


def test_matcher_terminates_on_eos_and_resets(backend, text_tokenizer, model_vocab) -> None:
    compiled = backend.compile("regex", "ok")
    m = compiled.matcher()
    ids = text_tokenizer.encode("ok", add_special_tokens=False)
    assert all(m.accept_token(t) for t in ids)
    assert not m.is_terminated()
    assert m.accept_token(model_vocab[1][0]) and m.is_terminated()
    assert not m.accept_token(ids[0])  # nothing after termination
    m.rollback(1)
    assert not m.is_terminated()
    m.reset()
    assert not m.accept_token(model_vocab[1][0])  # EOS is not allowed before the output is complete


def test_vocab_is_the_models(backend, model_vocab) -> None:
    assert backend.vocab_size == model_vocab[0]
    assert tuple(backend.allocate_bitmask(3).shape) == (3, (model_vocab[0] + 31) // 32)


def test_padded_vocab(model_dir, model_vocab) -> None:
    """Logits wider than the tokenizer (padded lm_head): the mask covers every column."""
    be = load_backend("xgrammar", model_dir, model_vocab[0] + 100, model_vocab[1])
    assert be.vocab_size == model_vocab[0] + 100
    assert be.allocate_bitmask(1).shape[1] * 32 >= model_vocab[0] + 100


def test_load_backend_none_and_unknown(model_dir) -> None:
    assert load_backend("none", model_dir, 10, [1]) is None
    with pytest.raises(ValueError, match="grammar_backend"):
        load_backend("outlines", model_dir, 10, [1])


def test_constraint_of_and_field() -> None:
    class P:
        json_schema = None
        regex = "a+"
        ebnf = None

    assert constraint_of(P()) == ("regex", "a+")
    assert constraint_of(object()) is None
    assert field_of("ebnf") == "sampling_params.ebnf"
