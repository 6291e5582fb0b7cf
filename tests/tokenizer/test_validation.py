"""Every validation rule rejects with INVALID_ARGUMENT naming its field; good input resolves defaults."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ringserve.errors import InvalidArgument, NotFound
from ringserve.message import SamplingParams
from ringserve.text_tokenizer import ChatTemplateError
from services.tokenizer.io_struct import ChatInput, GenerateInput
from services.tokenizer.validation import Limits, Prepared, prepare


@dataclass
class FakeTok:
    vocab_size: int = 100
    context_length: int = 50

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def encode_chat(self, messages, add_generation_prompt=True, continue_final_message=False, tools=None,
                    template_kwargs=None) -> list[int]:
        if messages[0]["role"] == "bad":
            raise ChatTemplateError("roles must alternate")
        return self.encode("".join(m["content"] for m in messages))


LIMITS = Limits(served_model_name="tiny", max_n=4, max_stop_strings=2, max_stop_len=5, max_top_logprobs=3)


def run(**kw) -> Prepared:
    sampling = kw.pop("sampling", {})
    kw.setdefault("text", "hello")
    return prepare(GenerateInput(sampling=SamplingParams(**sampling), **kw), FakeTok(), LIMITS)


CASES = [
    ("sampling_params.temperature", dict(sampling=dict(temperature=-0.1))),
    ("sampling_params.temperature", dict(sampling=dict(temperature=float("nan")))),
    ("sampling_params.top_p", dict(sampling=dict(top_p=0.0))),
    ("sampling_params.top_p", dict(sampling=dict(top_p=1.01))),
    ("sampling_params.top_k", dict(sampling=dict(top_k=-2))),
    ("sampling_params.min_p", dict(sampling=dict(min_p=1.5))),
    ("sampling_params.frequency_penalty", dict(sampling=dict(frequency_penalty=2.5))),
    ("sampling_params.presence_penalty", dict(sampling=dict(presence_penalty=-2.5))),
    ("sampling_params.repetition_penalty", dict(sampling=dict(repetition_penalty=0.0))),
    ("sampling_params.repetition_penalty", dict(sampling=dict(repetition_penalty=2.1))),
    ("sampling_params.min_new_tokens", dict(sampling=dict(min_new_tokens=10, max_new_tokens=5))),
    ("sampling_params.min_new_tokens", dict(text="x" * 40, sampling=dict(min_new_tokens=20))),
    ("sampling_params.n", dict(sampling=dict(n=0))),
    ("sampling_params.n", dict(sampling=dict(n=5))),
    ("sampling_params.stop", dict(sampling=dict(stop=("a", "b", "c")))),
    ("sampling_params.stop[0]", dict(sampling=dict(stop=("toolong",)))),
    ("sampling_params.stop[1]", dict(sampling=dict(stop=("a", "")))),
    ("sampling_params.stop_token_ids[0]", dict(sampling=dict(stop_token_ids=(100,)))),
    ("sampling_params.stop_token_ids[1]", dict(sampling=dict(stop_token_ids=(1, -1)))),
    ("sampling_params.logit_bias", dict(sampling=dict(logit_bias=((100, 1.0),)))),
    ("sampling_params.logit_bias", dict(sampling=dict(logit_bias=((-1, 1.0),)))),
    ("sampling_params.logit_bias", dict(sampling=dict(logit_bias=((5, 100.5),)))),
    ("sampling_params.logit_bias", dict(sampling=dict(logit_bias=((5, float("nan")),)))),
    ("sampling_params.stop_regex", dict(sampling=dict(stop_regex=("a", "b", "c")))),
    ("sampling_params.stop_regex[0]", dict(sampling=dict(stop_regex=("abcdef",)))),
    ("sampling_params.stop_regex[1]", dict(sampling=dict(stop_regex=("a", "(")))),
    ("sampling_params.stop_regex[0]", dict(sampling=dict(stop_regex=("a*",)))),
    ("sampling_params.stop_regex[0]", dict(sampling=dict(stop_regex=("(a+)+",)))),
    ("sampling_params.json_schema", dict(sampling=dict(json_schema="{not json"))),
    ("sampling_params.json_schema", dict(sampling=dict(json_schema="{}", regex="a"))),
    ("sampling_params.regex", dict(sampling=dict(regex="a", ebnf="root ::= x"))),
    ("sampling_params.max_new_tokens", dict(sampling=dict(max_new_tokens=46))),
    ("top_logprobs_num", dict(top_logprobs_num=4)),
    ("logprob_start_len", dict(logprob_start_len=-2)),
    ("text", dict(text="")),
    ("text", dict(text="x" * 50)),
    ("input_ids", dict(text=None, input_ids=[])),
    ("input_ids", dict(text=None, input_ids=[1, 100])),
    ("input_ids", dict(text=None, input_ids=[-1])),
    ("input", dict(text=None)),
    ("chat.messages", dict(text=None, chat=ChatInput(messages=[]))),
    ("chat", dict(text=None, chat=ChatInput(messages=[{"role": "bad", "content": "x"}]))),
]


@pytest.mark.parametrize("field,kw", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_names_its_field(field, kw):
    with pytest.raises(InvalidArgument) as e:
        run(**kw)
    assert e.value.field == field
    assert e.value.message.startswith(field + ": ")


def test_one_constraint_passes_to_every_sample():
    """Compiling is the scheduler's job: any one constraint passes; each of n samples carries it."""
    for kind, text in (("json_schema", '{"type": "object"}'), ("regex", "a+"), ("ebnf", "root ::= x")):
        p = run(sampling=dict(n=2, **{kind: text}))
        assert [getattr(s, kind) for s in p.samplings] == [text, text]
        assert all(getattr(s, k) is None for s in p.samplings for k in ("json_schema", "regex", "ebnf") if k != kind)


def test_constraint_messages():
    with pytest.raises(InvalidArgument) as e:
        run(sampling=dict(json_schema="{}", ebnf="root ::= x"))
    assert e.value.message == ("sampling_params.json_schema: at most one of json_schema, regex, ebnf "
                               "(got json_schema, ebnf)")
    with pytest.raises(InvalidArgument) as e:
        run(sampling=dict(json_schema="[1,"))
    assert e.value.message.startswith("sampling_params.json_schema: not valid JSON: ")


def test_model_mismatch_is_not_found():
    with pytest.raises(NotFound):
        run(model="other")
    run(model="tiny")


def test_defaults_resolved_and_unset_max_new_tokens_capped_to_room():
    p = run(text="x" * 45)
    (s,) = p.samplings
    assert s.max_new_tokens == 5 and s.temperature == 1.0 and s.top_p == 1.0 and s.top_k == -1
    assert s.repetition_penalty == 1.0 and s.skip_special_tokens and s.spaces_between_special_tokens
    assert run(text="hi").samplings[0].max_new_tokens == 50 - 2


def test_limits_on_the_edge_are_accepted():
    p = run(sampling=dict(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, frequency_penalty=-2,
                          presence_penalty=2, repetition_penalty=2.0, n=4, stop=("abcde", "x"),
                          stop_token_ids=(0, 99), max_new_tokens=45, min_new_tokens=45),
            top_logprobs_num=3)
    assert len(p.samplings) == 4 and p.samplings[0].top_k == -1 and p.samplings[0].max_new_tokens == 45


def test_n_expansion_offsets_seed():
    p = run(sampling=dict(n=3, seed=10))
    assert [s.seed for s in p.samplings] == [10, 11, 12]
    assert [s.seed for s in run(sampling=dict(n=2)).samplings] == [None, None]


def test_out_of_vocabulary_id_is_named_with_its_position():
    for ids, bad in (([1, 2, 100, 3, -4], "id 100 at position 2"), ([7, -1], "id -1 at position 1")):
        with pytest.raises(InvalidArgument) as e:
            run(text=None, input_ids=ids)
        assert e.value.message == f"input_ids: {bad} is outside [0, 100)"


def test_input_ids_used_as_given():
    assert run(text=None, input_ids=[5, 6, 7]).input_ids == [5, 6, 7]


def test_logit_bias_and_stop_regex_on_the_edge_are_accepted():
    sampling = dict(logit_bias=((0, -100.0), (99, 100.0)), stop_regex=(r"\d+x", "(?i)e"))
    assert run(sampling=sampling).samplings[0].logit_bias == ((0, -100.0), (99, 100.0))
