"""Finish decisions after each sampled token: length, EOS / stop token ids, stop strings, stop_regex.

Checked after every token, so a request ends on the token that completes a stop string (or a
stop_regex match) and no token past it is generated. Order follows SGLang: max_new_tokens first, then
tokens, then strings, then patterns; a pattern's finish reports the pattern as matched_str, as
SGLang's FINISHED_MATCHED_REGEX does.
"""

from __future__ import annotations

import functools

import grpc
import regex

from ringserve import stop_regex
from ringserve.message import Finish
from ringserve.text_tokenizer import TextTokenizer
from services.scheduler.core.req import Req

# A character is at most 4 UTF-8 bytes and a byte-level token at least one byte, so a stop string of
# k characters spans at most 4k tokens; +2 covers the token boundary on each side. A stop_regex counts
# as k = its span (the longest text it can match, capped at stop_regex.LOOKBACK_CHARS).
BYTES_PER_CHAR = 4
# A stop pattern runs on every token of its request inside the scheduler's loop, so it runs under a
# time limit: a pattern that backtracks exponentially (`(a|aa)+b` on a run of a's, a shape intake
# cannot rule out) ends its own request with INVALID_ARGUMENT instead of stalling every other one.
# The `regex` module (a transformers dependency) is used for its timeout; it reads `re` syntax.
STOP_REGEX_TIMEOUT_S = 0.02


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


class FinishChecker:
    def __init__(self, tokenizer: TextTokenizer | None, eos_token_ids: list[int], max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.max_seq_len = max_seq_len

    def stop_ids_for_min_tokens(self, req: Req) -> list[int]:
        """Ids the sampler must not pick while the request is still under min_new_tokens."""
        p = req.params
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids |= self.eos
        return sorted(ids)

    def check(self, req: Req) -> Finish | None:
        """Call after appending the newest token to req.output_ids."""
        p = req.params
        n = len(req.output_ids)
        if n >= p.max_tokens:
            return Finish("length")
        if n >= p.min_new_tokens:
            token = req.output_ids[-1]
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos):
                return Finish("stop", matched_token=token)
            if p.stop or p.stop_regex:
                stop = self._match_stop_str(req)
                if stop is not None:
                    return stop
        if req.seq_len >= self.max_seq_len:
            return Finish("length")
        return None

    def _match_stop_str(self, req: Req) -> Finish | None:
        """The finish for a stop string, else a stop_regex pattern, found in the decoded tail of the output."""
        if self.tokenizer is None:
            return None
        p = req.params
        if not req.stop_tail_tokens:
            chars = max(max((len(s) for s in p.stop), default=0), stop_regex.max_span(p.stop_regex))
            req.stop_tail_tokens = BYTES_PER_CHAR * chars + 2
        tail = req.output_ids[-req.stop_tail_tokens:]
        text = self.tokenizer.decode(tail, skip_special_tokens=p.skip_special_tokens)
        for s in p.stop:
            if s and s in text:
                return Finish("stop", matched_str=s)
        for i, pattern in enumerate(p.stop_regex):
            try:
                m = _compiled(pattern).search(text, timeout=STOP_REGEX_TIMEOUT_S)
            except TimeoutError:
                return Finish.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"sampling_params.stop_regex[{i}]: matching took over "
                                    f"{STOP_REGEX_TIMEOUT_S * 1000:.0f} ms (the pattern backtracks too much)")
            if m is not None:
                # matched_str is the pattern, as SGLang reports it; the detokenizer cuts the text at the
                # match start (the match end when no_stop_trim), counted from the end of the output text.
                trim = len(text) - (m.end() if p.no_stop_trim else m.start())
                return Finish("stop", matched_str=pattern, trim_chars=trim)
        return None
