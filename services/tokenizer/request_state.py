"""ReqState: what the tokenizer holds for one live internal request (SGLang's TokenizerManager.ReqState).

The detokenizer may send the same output twice (after a restart or a resubscribe it re-sends from
offset 0), so a state keeps how many ids and text code points it has received and `apply` keeps
only what is new. Ids and text advance independently: text can lag ids while the detokenizer holds
back half a character or a possible stop string.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from ringserve.errors import ServiceError
from ringserve.message import Finish, Logprob, TextDelta, Timings, TokenizedReq

from .parsers.chat_output import ChatOutput

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    """New output since the consumer last looked: text, ids and their logprobs."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    input_logprobs: list[Logprob] = field(default_factory=list)  # the prompt's, in one chunk only

    def empty(self) -> bool:
        return not self.text and not self.ids


class Wakeup(Protocol):
    """What a state calls when it has news: an asyncio.Event for a lone Generate call, or a
    GenerateStream session's mark-this-call-ready hook."""

    def set(self) -> None: ...


@dataclass
class ReqState:
    """One sample of one Generate call. `event` is shared by every sample of the call, so one
    consumer can wait for whichever sample moves next."""

    req: TokenizedReq
    group: str  # the client's rid
    index: int  # sample index in [0, n)
    scheduler: str  # address of the scheduler it was routed to
    event: Wakeup
    created: float = field(default_factory=time.monotonic)
    pending: Chunk = field(default_factory=Chunk)
    num_ids: int = 0  # output ids received (token_offset dedup)
    num_chars: int = 0  # output text code points received (text_offset dedup)
    finished: bool = False
    finish: Finish | None = None
    error: ServiceError | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str = ""  # of the weights computing it, from its first (and last) delta
    timings: Timings | None = None  # the scheduler's and detokenizer's, with the finish
    ring_hops_s: float = 0.0  # scheduler -> detokenizer -> tokenizer, summed over its messages
    first_token_at: float | None = None
    last_token_at: float | None = None
    input_logprobs_seen: bool = False  # a resync may send them again: pass them on once
    output: ChatOutput | None = None  # a chat sample's reasoning / tool-call parsing, when it has any
    gaps: int = 0  # deltas dropped because they started past what this state holds

    @property
    def rid(self) -> str:
        return self.req.rid

    def apply(self, delta: TextDelta, now: float | None = None) -> int:
        """Merge a delta, dropping what was already received. Returns the number of new ids.

        A delta that starts past what this state holds (a lost message: its ids or text would be
        spliced on at the wrong place) is dropped whole, finish included: every way a message can be
        lost (a detokenizer restarted, a subscription replaced, a backlog overflowed) is followed by
        a resync, which re-sends this request from offset 0, and the dedup below takes the rest from it.
        Splicing instead made the gap permanent: the resync's overlap is skipped by count, so the
        missing piece never came and the text no longer matched the ids (issue #31)."""
        if self.finished:
            return 0
        if delta.token_offset > self.num_ids or delta.text_offset > self.num_chars:
            self.gaps += 1
            log.warning("rid=%s gap: have %d ids / %d chars, delta starts at %d / %d; dropped until the "
                        "resync", self.rid, self.num_ids, self.num_chars, delta.token_offset, delta.text_offset)
            return 0
        new_ids = 0
        if delta.ids:
            skip = self.num_ids - delta.token_offset
            fresh = delta.ids[skip:]
            if fresh:
                self.pending.ids.extend(fresh)
                if delta.logprobs:
                    self.pending.logprobs.extend(delta.logprobs[skip:])
                self.num_ids += len(fresh)
                new_ids = len(fresh)
        if delta.text:
            fresh_text = delta.text[self.num_chars - delta.text_offset:]
            if fresh_text:
                self.pending.text += fresh_text
                self.num_chars += len(fresh_text)
        if delta.input_logprobs and not self.input_logprobs_seen:
            self.pending.input_logprobs = delta.input_logprobs
            self.input_logprobs_seen = True
        if delta.prompt_tokens:
            self.prompt_tokens = delta.prompt_tokens
        if delta.cached_tokens:
            self.cached_tokens = delta.cached_tokens
        if delta.weight_version:
            self.weight_version = delta.weight_version
        if new_ids:
            now = time.monotonic() if now is None else now
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        if delta.finish is not None:
            self.finished = True
            self.finish = delta.finish
            self.timings = delta.timings
        return new_ids

    def fail(self, error: ServiceError) -> None:
        """End the request with an error status (scheduler gone, rejection, detokenizer gone)."""
        if self.finished:
            return
        self.finished = True
        self.error = error
        self.event.set()

    def abort(self, message: str) -> None:
        """End the request cleanly with finish_reason abort (status OK)."""
        if self.finished:
            return
        self.finished = True
        self.finish = Finish(type="abort", message=message)
        self.event.set()

    def take(self) -> Chunk:
        chunk, self.pending = self.pending, Chunk()
        return chunk
