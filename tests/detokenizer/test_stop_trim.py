"""Stop strings and stop_regex: hold back, trim at the match, never send text past a stop."""

from __future__ import annotations

from conftest import run_request, split  # type: ignore[import-not-found]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve import stop_regex
from ringserve.message import DecodeParams, Finish, SamplingParams, TextDelta
from ringserve.text_tokenizer import TextTokenizer
from services.detokenizer.detokenizer import Detokenizer
from services.detokenizer.stop_trim import StopTrimmer, held_suffix_len
from services.scheduler.core.finish import FinishChecker
from services.scheduler.core.req import Req


def scheduler_stop(tok: TextTokenizer, ids: list[int], stops: list[str]) -> tuple[list[int], Finish, str]:
    """What the scheduler does: stop after the first token whose output text contains a stop."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        for s in stops:
            if s in text:
                return ids[:k], Finish("stop", matched_str=s), text
    return ids, Finish("length"), tok.decode(ids)


def stream(tok: TextTokenizer, text: str, stops: list[str], sizes: list[int] | None = None,
           no_stop_trim: bool = False) -> tuple[list[TextDelta], Finish, str]:
    ids, finish, full = scheduler_stop(tok, tok.encode(text, add_special_tokens=False), stops)
    params = DecodeParams(owner="o", sampling=SamplingParams(stop=tuple(stops), no_stop_trim=no_stop_trim))
    deltas = run_request(Detokenizer(tok), split(ids, sizes or [1]), params, finish)
    return deltas, finish, full


def out(deltas: list[TextDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_stop_split_across_steps(tiny_tok: TextTokenizer) -> None:
    stop = "brown fox"
    ids = tiny_tok.encode("the quick brown fox jumps", add_special_tokens=False)
    cut, _, _ = scheduler_stop(tiny_tok, ids, [stop])
    assert len(tiny_tok.encode(" " + stop, add_special_tokens=False)) >= 2  # really spans tokens
    for sizes in ([1], [2], [1, 2]):
        deltas, finish, full = stream(tiny_tok, "the quick brown fox jumps", [stop], sizes)
        assert out(deltas) == "the quick "
        assert deltas[-1].finish == finish and finish.matched_str == stop
        assert all("b" not in d.text for d in deltas)  # never a byte of the stop before the finish


def test_stop_inside_multibyte_character(tiny_tok: TextTokenizer, sp_tok: TextTokenizer) -> None:
    for tok in (tiny_tok, sp_tok):
        for stop in ("🦀", "京🦀", "😀x"):
            text = "ab 東京🦀😀xyz tail"
            deltas, finish, _ = stream(tok, text, [stop])
            assert finish.matched_str == stop
            assert out(deltas) == text[:text.find(stop)]
            assert all("\ufffd" not in d.text for d in deltas)


def test_overlapping_stop_strings(tiny_tok: TextTokenizer) -> None:
    text = "one two three four"
    deltas, finish, _ = stream(tiny_tok, text, ["two three", "o t"])
    assert finish.matched_str == "o t"  # completes first
    assert out(deltas) == "one tw"
    deltas, finish, _ = stream(tiny_tok, text, ["three four", "thr"])
    assert finish.matched_str == "thr" and out(deltas) == "one two "


def test_no_stop_trim_keeps_the_stop(tiny_tok: TextTokenizer) -> None:
    deltas, finish, full = stream(tiny_tok, "say hello world and more", ["lo wor"], [2], no_stop_trim=True)
    assert out(deltas) == "say hello wor"
    assert full.startswith(out(deltas))


def test_stop_token_dropped_unless_no_stop_trim(tiny_tok: TextTokenizer) -> None:
    ids = tiny_tok.encode("hi there", add_special_tokens=False) + [1]  # </s>
    for keep, want in ((False, "hi there"), (True, "hi there</s>")):
        params = DecodeParams(owner="o", sampling=SamplingParams(skip_special_tokens=False, no_stop_trim=keep))
        deltas = run_request(Detokenizer(tiny_tok), split(ids, [1]), params, Finish("stop", matched_token=1))
        assert out(deltas) == want
        assert [i for d in deltas for i in d.ids] == ids  # the id is still reported


def test_non_streaming_gets_one_delta(tiny_tok: TextTokenizer) -> None:
    ids = tiny_tok.encode("all at once 東京", add_special_tokens=False)
    params = DecodeParams(owner="o", stream=False, sampling=SamplingParams(stop=("once",)))
    deltas = run_request(Detokenizer(tiny_tok), split(ids, [2]), params, Finish("length"))
    assert len(deltas) == 1
    assert deltas[0].text == "all at once 東京" and deltas[0].ids == ids
    assert deltas[0].token_offset == 0 and deltas[0].text_offset == 0


def test_held_suffix_len() -> None:
    assert held_suffix_len("xab", ("abc",)) == 2
    assert held_suffix_len("xabc", ("abc",)) == 0  # a complete stop without a finish is released
    assert held_suffix_len("xa", ("abc", "ax")) == 1
    t = StopTrimmer(("abc",), False)
    assert t.feed("xa") == "x" and t.feed("b") == "" and t.feed("d") == "abd"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="ab 東🦀é\u0301", min_size=1, max_size=30),
       stops=st.lists(st.text(alphabet="ab 東🦀é\u0301", min_size=1, max_size=4), min_size=1, max_size=3),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5), keep=st.booleans())
def test_stop_property(tiny_tok: TextTokenizer, text: str, stops: list[str], sizes: list[int], keep: bool) -> None:
    deltas, finish, full = stream(tiny_tok, text, stops, sizes, no_stop_trim=keep)
    got = out(deltas)
    if finish.matched_str is None:
        assert got == full
    else:
        s = finish.matched_str
        want = full[:full.find(s) + (len(s) if keep else 0)]
        assert got == want


# -- stop_regex: the scheduler's FinishChecker decides, the trimmer holds back and cuts ----------------


def regex_stream(tok: TextTokenizer, text: str, patterns: list[str], sizes: list[int] | None = None,
                 no_stop_trim: bool = False, stream_: bool = True) -> tuple[list[TextDelta], Finish, str]:
    """The real scheduler finish check over the ids of `text`, then the detokenizer over the kept ids."""
    sp = SamplingParams(stop_regex=tuple(patterns), no_stop_trim=no_stop_trim, max_new_tokens=1000)
    checker = FinishChecker(tok, eos_token_ids=[], max_seq_len=100_000)
    req = Req("r", [0], sp)
    finish = Finish("length")
    for t in tok.encode(text, add_special_tokens=False):
        req.output_ids.append(t)
        fin = checker.check(req)
        if fin is not None:
            finish = fin
            break
    params = DecodeParams(owner="o", stream=stream_, sampling=sp)
    deltas = run_request(Detokenizer(tok), split(req.output_ids, sizes or [1]), params, finish)
    return deltas, finish, tok.decode(req.output_ids)


def test_regex_match_across_tokens_is_cut_at_its_start(tiny_tok: TextTokenizer, sp_tok: TextTokenizer) -> None:
    text = "Order 66 shipped: 12345 units to 東京🦀 today"
    for tok in (tiny_tok, sp_tok):
        for sizes in ([1], [3], [1, 2]):
            deltas, finish, _ = regex_stream(tok, text, [r"\d{3}"], sizes)
            assert finish.type == "stop" and finish.matched_str == r"\d{3}"
            assert out(deltas) == "Order 66 shipped: "
            assert all("1" not in d.text for d in deltas)  # nothing of the match ever went out
        deltas, finish, _ = regex_stream(tok, text, [r"東京.", "nomatch"], [2])
        assert finish.matched_str == r"東京." and out(deltas) == "Order 66 shipped: 12345 units to "


def test_regex_no_stop_trim_keeps_the_match(tiny_tok: TextTokenizer) -> None:
    for stream_ in (True, False):
        deltas, finish, full = regex_stream(tiny_tok, "the quick brown fox jumps", [r"b\w+n"], [2],
                                            no_stop_trim=True, stream_=stream_)
        assert finish.matched_str == r"b\w+n"
        assert out(deltas) == "the quick brown"
        deltas, _, _ = regex_stream(tiny_tok, "the quick brown fox jumps", [r"b\w+n"], [2], stream_=stream_)
        assert out(deltas) == "the quick "


def test_regex_hold_back_is_the_patterns_span() -> None:
    t = StopTrimmer((), False, ("ab?c",))  # at most 3 characters: the last 3 wait
    assert t.feed("hello") == "he" and t.feed(" w") == "ll" and t.finish("x", None) == "o wx"
    t = StopTrimmer((), False, (r"\d+",))  # unbounded: capped at the lookback
    assert t.feed("x" * 100) == "x" * (100 - stop_regex.LOOKBACK_CHARS)
    # A stop_regex finish cuts trim_chars from the end of the output; past what is unsent, all of it.
    t = StopTrimmer((), False, ("ab?c",))
    assert t.feed("hello ab") == "hello" and t.finish("c!", "ab?c", "r", trim_chars=4) == " "
    assert StopTrimmer((), False, ("a",)).finish("xyz", "a", "r", trim_chars=10) == ""
