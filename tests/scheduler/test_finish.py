"""FinishChecker on stop_regex: the match ends the request on the token that completes it, the finish
names the pattern and says how much text to cut; a pattern that backtracks too long aborts its request."""

from __future__ import annotations

import time
from typing import cast

import grpc

from ringserve.message import SamplingParams
from ringserve.text_tokenizer import TextTokenizer
from services.scheduler.core.finish import STOP_REGEX_TIMEOUT_S, FinishChecker
from services.scheduler.core.req import Req

PIECES = ["Total", ": ", "4", "2", " apples", ".", "\n", "a", "b", "c"]  # token id -> text


class PieceTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i] for i in ids)


CHECKER = FinishChecker(cast(TextTokenizer, PieceTokenizer()), eos_token_ids=[99], max_seq_len=10_000)


def feed(ids: list[int], **params: object) -> tuple[Req, int]:
    """Append ids one at a time as the scheduler does; return the request and the tokens it kept."""
    req = Req("r", [0], SamplingParams(max_new_tokens=500, **params))  # type: ignore[arg-type]
    for k, t in enumerate(ids, 1):
        req.output_ids.append(t)
        req.finished_reason = CHECKER.check(req)
        if req.finished_reason is not None:
            return req, k
    return req, len(ids)


def test_match_across_tokens_ends_on_the_completing_token_and_names_the_pattern() -> None:
    ids = [0, 1, 2, 3, 4, 5, 6]  # "Total: 42 apples.\n"
    req, kept = feed(ids, stop_regex=(r"\d+ app",))
    assert kept == 5  # " apples" completes "42 app"
    fin = req.finished_reason
    assert fin is not None and fin.type == "stop" and fin.matched_str == r"\d+ app"
    text = PieceTokenizer().decode(ids[:kept])
    assert fin.trim_chars is not None and text[:len(text) - fin.trim_chars] == "Total: "


def test_no_stop_trim_cuts_only_what_follows_the_match() -> None:
    req, kept = feed([0, 1, 2, 3, 4, 5], stop_regex=(r"\d+ app",), no_stop_trim=True)
    fin = req.finished_reason
    assert fin is not None and fin.trim_chars == len("les")  # "Total: 42 app" is kept


def test_stop_strings_first_then_patterns_in_order_and_min_new_tokens() -> None:
    req, _ = feed([0, 1, 2], stop=(": ",), stop_regex=("Tot",))
    assert req.finished_reason is not None and req.finished_reason.matched_str == "Tot"  # on token 0
    req, _ = feed([0, 1, 2], stop=("tal",), stop_regex=("Tot",))
    assert req.finished_reason is not None and req.finished_reason.matched_str == "tal"
    assert req.finished_reason.trim_chars is None  # a stop string: the detokenizer finds it itself
    req, kept = feed([0, 1, 2, 3], stop_regex=(r"[0-9]", "Total"), min_new_tokens=3)
    assert kept == 3 and req.finished_reason is not None and req.finished_reason.matched_str == "[0-9]"
    req, kept = feed([0, 1, 4, 5], stop_regex=(r"\d",))
    assert req.finished_reason is None and kept == 4


def test_catastrophic_pattern_aborts_its_request_quickly() -> None:
    t0 = time.monotonic()
    req, kept = feed([7] * 40, stop_regex=(r"(a|aa)+b",))
    fin = req.finished_reason
    assert fin is not None and fin.type == "abort" and fin.status == grpc.StatusCode.INVALID_ARGUMENT
    assert fin.message.startswith("sampling_params.stop_regex[0]: ")
    assert kept < 40 and time.monotonic() - t0 < 40 * STOP_REGEX_TIMEOUT_S + 2.0
