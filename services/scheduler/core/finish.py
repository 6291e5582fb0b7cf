"""Finish decisions after each sampled token: length, EOS / stop token ids, stop strings.

Checked after every token, so a request ends on the token that completes a stop string and no token
past it is generated. Order follows SGLang: max_new_tokens first, then tokens, then strings.
"""

from __future__ import annotations

from ringserve.message import Finish
from ringserve.text_tokenizer import TextTokenizer
from services.scheduler.core.req import Req

# A character is at most 4 UTF-8 bytes and a byte-level token at least one byte, so a stop string of
# k characters spans at most 4k tokens; +2 covers the token boundary on each side.
BYTES_PER_CHAR = 4


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
            if p.stop:
                matched = self._match_stop_str(req)
                if matched is not None:
                    return Finish("stop", matched_str=matched)
        if req.seq_len >= self.max_seq_len:
            return Finish("length")
        return None

    def _match_stop_str(self, req: Req) -> str | None:
        if self.tokenizer is None:
            return None
        if not req.stop_tail_tokens:
            req.stop_tail_tokens = BYTES_PER_CHAR * max(len(s) for s in req.params.stop) + 2
        tail = req.output_ids[-req.stop_tail_tokens:]
        text = self.tokenizer.decode(tail, skip_special_tokens=req.params.skip_special_tokens)
        for s in req.params.stop:
            if s and s in text:
                return s
        return None
