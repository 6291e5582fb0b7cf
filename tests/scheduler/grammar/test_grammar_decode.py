"""Masked random decoding over the default model's vocabulary ends in strings the constraint matches.

Each sampled token must be accepted by its matcher (a token the mask let through but the grammar
refuses is a masking bug), and the decoded text must parse / validate / fullmatch independently of
xgrammar (json + jsonschema, re, a hand-written parser for the EBNF).
"""

from __future__ import annotations

import json
import re
import zlib

import jsonschema
import pytest
import torch

from services.scheduler.grammar import GrammarMasker
from services.scheduler.grammar.simulate import SimRow, random_decode

SAMPLES = 6       # rows decoded per constraint, in one batch
MAX_STEPS = 400   # every constraint below ends well within this under uniform sampling

SCHEMAS = {
    "nested_required": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"]},
        },
        "required": ["name", "age", "address"],
    },
    "arrays_enums": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
            "matrix": {"type": "array", "maxItems": 2,
                       "items": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9},
                                 "maxItems": 3}},
            "mode": {"const": "fast"},
        },
        "required": ["colors", "matrix", "mode"],
    },
    "numbers_bools": {
        "type": "object",
        "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}, "nothing": {"type": "null"},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["x", "ok", "nothing"],
    },
    "top_level_array": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}}, "required": ["id"]}, "maxItems": 3},
}

REGEXES = [
    r"[0-9]{3}-[a-z]{2,5}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}\.",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
]

ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)?
term ::= factor (("*" | "/") factor)?
factor ::= num | "(" inner ")"
inner ::= num (("+" | "-" | "*") num)?
num ::= [1-9] [0-9]?
"""


def _decode(backend, text_tokenizer, compiled, seed: int, apply_mask: bool = True) -> list[tuple[str, SimRow]]:
    masker = GrammarMasker(backend, SAMPLES)
    rows = random_decode(masker, [compiled.matcher() for _ in range(SAMPLES)], MAX_STEPS,
                         torch.Generator().manual_seed(seed), apply_mask=apply_mask)
    out = []
    for r in rows:
        assert r.rejected is None, f"the mask let through token {r.rejected} the grammar refuses"
        assert r.terminated, f"no stop token after {len(r.ids)} tokens: {text_tokenizer.decode(r.ids)!r}"
        out.append((text_tokenizer.decode(r.ids), r))
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(backend, text_tokenizer, model_vocab, name: str) -> None:
    schema = SCHEMAS[name]
    compiled = backend.compile("json_schema", json.dumps(schema))
    for text, row in _decode(backend, text_tokenizer, compiled, seed=zlib.crc32(name.encode())):
        assert row.ids[-1] in model_vocab[1]  # ends on EOS, which the text drops
        jsonschema.validate(json.loads(text), schema)


def test_any_object_outputs_are_objects(backend, text_tokenizer) -> None:
    """response_format json_object's schema: keys and strings are unbounded, so a row may run out of
    steps; every row that ended is a JSON object, and none ever sampled a refused token."""
    masker = GrammarMasker(backend, SAMPLES)
    compiled = backend.compile("json_schema", '{"type": "object"}')
    rows = random_decode(masker, [compiled.matcher() for _ in range(SAMPLES)], MAX_STEPS,
                         torch.Generator().manual_seed(11))
    assert all(r.rejected is None for r in rows)
    ended = [r for r in rows if r.terminated]
    assert ended
    for r in ended:
        assert isinstance(json.loads(text_tokenizer.decode(r.ids)), dict)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(backend, text_tokenizer, pattern: str) -> None:
    compiled = backend.compile("regex", pattern)
    for text, _ in _decode(backend, text_tokenizer, compiled, seed=len(pattern)):
        assert re.fullmatch(pattern, text), text


def _parse_arith(s: str) -> None:
    """Recursive descent for ARITH_EBNF; raises ValueError unless s is exactly one expr."""
    pos = 0

    def eat(chars: str) -> str | None:
        nonlocal pos
        if pos < len(s) and s[pos] in chars:
            pos += 1
            return s[pos - 1]
        return None

    def num() -> None:
        if not eat("123456789"):
            raise ValueError(f"number expected at {pos} in {s!r}")
        eat("0123456789")

    def factor() -> None:
        if eat("("):
            num()
            if eat("+-*"):
                num()
            if not eat(")"):
                raise ValueError(f"')' expected at {pos} in {s!r}")
        else:
            num()

    def term() -> None:
        factor()
        if eat("*/"):
            factor()

    term()
    if eat("+-"):
        term()
    if pos != len(s):
        raise ValueError(f"trailing {s[pos:]!r} in {s!r}")


def test_ebnf_outputs_parse(backend, text_tokenizer) -> None:
    compiled = backend.compile("ebnf", ARITH_EBNF)
    texts = [t for t, _ in _decode(backend, text_tokenizer, compiled, seed=7)]
    for t in texts:
        _parse_arith(t)
    assert len(set(texts)) > 1  # random logits explore the grammar, not one path


def test_parser_rejects_bad_arith() -> None:
    for bad in ("", "1+", "(1", "01", "1+2+3", "((1))", "1 + 2"):
        with pytest.raises(ValueError):
            _parse_arith(bad)


def test_unmasked_sampling_is_caught(backend, text_tokenizer) -> None:
    """Without the mask the same loop samples tokens the grammar refuses: the checks above can fail."""
    compiled = backend.compile("json_schema", json.dumps(SCHEMAS["nested_required"]))
    masker = GrammarMasker(backend, SAMPLES)
    rows = random_decode(masker, [compiled.matcher() for _ in range(SAMPLES)], MAX_STEPS,
                         torch.Generator().manual_seed(1), apply_mask=False)
    assert all(r.rejected is not None for r in rows)


def test_every_unmasked_token_is_accepted_and_masked_ones_refused(backend) -> None:
    """Exhaustive over the vocabulary for a few positions: finite logit <=> accept_token succeeds."""
    compiled = backend.compile("json_schema", json.dumps(SCHEMAS["arrays_enums"]))
    matcher = compiled.matcher()
    masker = GrammarMasker(backend, 1)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        logits = torch.randn(1, backend.vocab_size, generator=g)
        masker.apply(logits, [matcher])
        allowed = torch.isfinite(logits[0])
        assert 0 < int(allowed.sum()) < backend.vocab_size
        for tok in range(backend.vocab_size):
            ok = matcher.accept_token(tok)
            assert ok == bool(allowed[tok]), tok
            if ok:
                matcher.rollback(1)
        choice = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g))
        assert matcher.accept_token(choice)
