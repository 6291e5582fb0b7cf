"""Property tests: concatenated deltas equal the full decode, with no early U+FFFD."""

from __future__ import annotations

from conftest import TEXTS, run_request, split  # type: ignore[import-not-found]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve.message import DecodeParams, SamplingParams
from ringserve.text_tokenizer import TextTokenizer
from services.detokenizer.decode_state import MAX_WINDOW
from services.detokenizer.detokenizer import Detokenizer

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
sizes_st = st.lists(st.integers(1, 5), min_size=1, max_size=8)


def check(tok: TextTokenizer, ids: list[int], sizes: list[int], skip: bool) -> None:
    assert len(ids) < MAX_WINDOW  # the no-U+FFFD guarantee holds below the window cap
    det = Detokenizer(tok)
    params = DecodeParams(owner="o", sampling=SamplingParams(skip_special_tokens=skip))
    deltas = run_request(det, split(ids, sizes), params)
    full = tok.decode(ids, skip_special_tokens=skip)
    text = "".join(d.text for d in deltas)
    assert text == full
    offset = 0
    for d in deltas:
        assert d.text_offset == offset
        offset += len(d.text)
        if "\ufffd" in d.text:
            assert "\ufffd" in full
    assert [i for d in deltas for i in d.ids] == ids
    assert len(det) == 0  # freed at finish


def ids_st(tok: TextTokenizer) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, tok.vocab_size - 1), max_size=120)


@SETTINGS
@given(data=st.data(), sizes=sizes_st, skip=st.booleans())
def test_random_ids_byte_level(tiny_tok: TextTokenizer, data: st.DataObject, sizes: list[int], skip: bool) -> None:
    check(tiny_tok, data.draw(ids_st(tiny_tok)), sizes, skip)


@SETTINGS
@given(data=st.data(), sizes=sizes_st, skip=st.booleans())
def test_random_ids_byte_fallback(sp_tok: TextTokenizer, data: st.DataObject, sizes: list[int], skip: bool) -> None:
    check(sp_tok, data.draw(ids_st(sp_tok)), sizes, skip)


unicode_text = st.text(alphabet=st.sampled_from(list("ab \u0301\u0308東京😀🚀👍🏽\u200d👨é中✨。🦀ß漢")) , max_size=40)


@SETTINGS
@given(text=st.one_of(st.sampled_from(TEXTS), unicode_text), sizes=sizes_st)
def test_real_text_both_tokenizers(tiny_tok: TextTokenizer, sp_tok: TextTokenizer, text: str,
                                   sizes: list[int]) -> None:
    for tok in (tiny_tok, sp_tok):
        ids = tok.encode(text, add_special_tokens=False)
        check(tok, ids, sizes, True)


def test_multibyte_chars_are_split_across_tokens(tiny_tok: TextTokenizer, sp_tok: TextTokenizer) -> None:
    """The tests above only mean something if characters really span several ids."""
    for tok in (tiny_tok, sp_tok):
        ids = tok.encode("🦀", add_special_tokens=False)
        assert len(ids) > 1
        assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))


def test_one_token_steps_hold_half_characters(tiny_tok: TextTokenizer) -> None:
    ids = tiny_tok.encode("a😀b", add_special_tokens=False)
    deltas = run_request(Detokenizer(tiny_tok), [[i] for i in ids], DecodeParams(owner="o"))
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == "a😀b"
    assert any(d.text == "" for d in deltas)  # some steps had only half a character


def test_skipped_special_inside_byte_run(sp_tok: TextTokenizer) -> None:
    """Found by hypothesis: <0x00> <unk> <0xNN> is one byte run once <unk> is skipped."""
    byte0, byte_hi = sp_tok.tokenizer.token_to_id("<0x00>"), sp_tok.tokenizer.token_to_id("<0xE6>")
    check(sp_tok, [byte0, 0, byte_hi], [1], True)
    check(sp_tok, [byte0, 0, byte_hi], [1], False)
