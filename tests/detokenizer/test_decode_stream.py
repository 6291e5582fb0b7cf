"""The DecodeStream (Rust) path of the decode state against the batched Python path and the full decode.

Each request is streamed twice, once per path, with the same chunks; the text of every step must be
the same on both (not only the concatenation), and, independently of the Python path, the text sent
after each step must be exactly the longest complete prefix of decode(ids so far): all of it when that
decode does not end in U+FFFD (nothing held longer than needed), never past it (no half character,
no text that a later id changes). A wrong increment (a character dropped, sent twice, sent early or
held a step too long) fails one of the two.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TEXTS, split  # type: ignore[import-not-found]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve.message import DecodeParams, Finish, SamplingParams, StepBatch, TextDelta, TokenDelta
from ringserve.text_tokenizer import TextTokenizer
from services.detokenizer.decode_state import MAX_WINDOW, DecodeJob, IncrementalDecoder
from services.detokenizer.detokenizer import Detokenizer

FFFD = "\ufffd"
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
sizes_st = st.lists(st.integers(1, 4), min_size=1, max_size=6)
unicode_text = st.text(alphabet=st.sampled_from(list("ab \n\t{}():=_\u0301東京😀🚀👍🏽\u200d👨é中✨。🦀ß")),
                       max_size=30)


@pytest.fixture(scope="module")
def smol(real_model_dir: str) -> TextTokenizer:
    return TextTokenizer.from_model(real_model_dir)


def stream_steps(tok: TextTokenizer, chunks: list[list[int]], skip: bool, use_stream: bool,
                 stop: tuple[str, ...] = ()) -> list[str]:
    """The text of each step of one streamed request (the last chunk carries the finish)."""
    det = Detokenizer(tok)
    det.decoder.use_stream = use_stream
    params = DecodeParams(owner="o", sampling=SamplingParams(skip_special_tokens=skip, stop=stop))
    texts: list[str] = []
    offset = 0
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        delta = TokenDelta("r", list(chunk), offset, params if i == 0 else None,
                           finish=Finish("length") if last else None)
        offset += len(chunk)
        batches, _ = det.step(StepBatch([delta]))
        if i == 0 and not last:
            assert (det.states["r"].decode.stream is not None) is use_stream
        deltas: list[TextDelta] = [d for b in batches for d in b.deltas]
        assert len(deltas) == 1
        texts.append(deltas[0].text)
    assert len(det) == 0
    return texts


def check_both_paths(tok: TextTokenizer, ids: list[int], sizes: list[int], skip: bool) -> list[str]:
    chunks = split(ids, sizes) or [[]]
    fast = stream_steps(tok, chunks, skip, use_stream=True)
    assert fast == stream_steps(tok, chunks, skip, use_stream=False)
    # The oracle, independent of either path.
    assert "".join(fast) == tok.decode(ids, skip_special_tokens=skip)
    sent, n = "", 0
    for chunk, text in zip(chunks[:-1], fast):
        sent, n = sent + text, n + len(chunk)
        so_far = tok.decode(ids[:n], skip_special_tokens=skip)
        assert so_far.startswith(sent)
        # (CleanUpStream holds text a clean-up pattern may still span: a hold by design.)
        if len(ids) < MAX_WINDOW and not so_far.endswith(FFFD) and not tok.clean_up_tokenization_spaces:
            assert sent == so_far, "text held longer than the decoder needs"
        assert FFFD not in sent or FFFD in tok.decode(ids, skip_special_tokens=skip)
    return fast


@SETTINGS
@given(text=st.one_of(st.sampled_from(TEXTS), unicode_text), sizes=sizes_st, skip=st.booleans())
def test_text_same_increments_as_python_path(smol: TextTokenizer, text: str, sizes: list[int], skip: bool) -> None:
    check_both_paths(smol, smol.encode(text, add_special_tokens=False), sizes, skip)


@SETTINGS
@given(data=st.data(), sizes=sizes_st, skip=st.booleans())
def test_random_ids_and_specials_same_increments(smol: TextTokenizer, data: st.DataObject, sizes: list[int],
                                                  skip: bool) -> None:
    specials = sorted(smol.special_ids)
    id_st = st.one_of(st.integers(0, smol.vocab_size - 1), st.sampled_from(specials))
    check_both_paths(smol, data.draw(st.lists(id_st, max_size=40)), sizes, skip)


def test_utf8_character_split_across_tokens(smol: TextTokenizer) -> None:
    """Byte-level BPE spells 😀 as several ids: the stream holds the half character, sends it whole."""
    ids = smol.encode("a😀b", add_special_tokens=False)
    assert any(smol.decode(ids[:k]).endswith(FFFD) for k in range(1, len(ids)))  # really split
    steps = check_both_paths(smol, ids, [1], True)
    assert steps[0] == "a" and "" in steps and "😀" in steps and steps[-1] == "b"
    assert all(FFFD not in t for t in steps)


def test_finish_mid_character_flushes_what_the_decoder_gives(smol: TextTokenizer) -> None:
    """Output cut inside a character: the finish sends the U+FFFD that decode(ids) has, nothing lost."""
    ids = smol.encode("ok 😀", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if smol.decode(ids[:k]).endswith(FFFD))
    steps = check_both_paths(smol, ids[:cut], [1], True)
    assert steps[-1].endswith(FFFD) and "".join(steps) == smol.decode(ids[:cut])


def test_window_cap_moves_garbage_to_python_path(smol: TextTokenizer) -> None:
    """Ids that never complete a character: past MAX_WINDOW the request leaves the stream, and its
    text (U+FFFDs sent early, as the Python path does) is the same per step."""
    lead = next(i for i in range(smol.vocab_size) if smol.decode([i]) == FFFD)
    ids = [lead] * (MAX_WINDOW + 20)
    chunks = split(ids, [7])
    fast = stream_steps(smol, chunks, True, use_stream=True)
    assert fast == stream_steps(smol, chunks, True, use_stream=False)
    assert "".join(fast) == smol.decode(ids)
    assert any(FFFD in t for t in fast[:-1])  # garbage is not held to the end

    dec = IncrementalDecoder(smol)
    state = dec.new_state(True)
    state.append(ids)
    dec.step([DecodeJob(state, False)])
    assert state.stream is None


def test_clean_up_tokenizer_on_the_stream_path(smol: TextTokenizer) -> None:
    """clean_up_tokenization_spaces (Llama 3's tokenizer_config) runs on the stream's committed text."""
    tok = dataclasses.replace(smol, clean_up_tokenization_spaces=True)
    assert IncrementalDecoder(tok).use_stream
    ids = tok.encode("I 'm here , right ? It 's n't a do n't . 😀 ok !", add_special_tokens=False)
    for sizes in ([1], [2, 3]):
        check_both_paths(tok, ids, sizes, True)


def test_stop_strings_on_the_stream_path(smol: TextTokenizer) -> None:
    ids = smol.encode("one two three four five", add_special_tokens=False)
    chunks = split(ids, [1])
    fast = stream_steps(smol, chunks, True, True, stop=("three f",))
    assert fast == stream_steps(smol, chunks, True, False, stop=("three f",))
    assert "".join(fast) == "one two three four five"  # no finish on the stop: everything released
    assert "three" not in "".join(fast[:3])  # held while it may start the stop


def test_byte_fallback_tokenizer_stays_on_python_path(sp_tok: TextTokenizer) -> None:
    assert not IncrementalDecoder(sp_tok).use_stream
    assert IncrementalDecoder(sp_tok).new_state(True).stream is None


def test_stream_error_moves_request_to_python_path(sp_tok: TextTokenizer) -> None:
    """Forced onto a byte-fallback tokenizer, DecodeStream sees its sent "A" turn into U+FFFDs
    (<0x41><0x80> is an invalid run) and raises: the request goes on on the Python path, the step
    does not fail."""
    dec = IncrementalDecoder(sp_tok)
    dec.use_stream = True
    state = dec.new_state(False)
    byte = sp_tok.tokenizer.token_to_id
    texts = []
    for i in (byte("<0x41>"), byte("<0x80>"), sp_tok.encode("x", add_special_tokens=False)[-1]):
        state.append([i])
        texts.extend(dec.step([DecodeJob(state, False)]))
    assert texts[0] == "A" and state.stream is None
