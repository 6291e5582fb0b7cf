"""Incremental decoding of one request's output ids, batched over every request of a step.

The decode window follows SGLang's DetokenizerManager: a request keeps the ids from its
*surrogate offset* on; `read` marks how many of them are already turned into sent text. Each step
decodes `ids[surr:]` and `ids[surr:read]` and the new text is the difference. Decoding a window
rather than a single token keeps decoders that look at neighbours (byte-level BPE merging bytes of
one character, Metaspace/Strip dropping the leading space of the first token) correct.

The new text is committed (and the window slides: surr <- read, read <- end) only when it
  - is not empty (so the window's committed part always holds a token the decoder sees, which keeps
    "first token" rules such as Metaspace's leading-space strip aligned with the full decode),
  - does not end in U+FFFD (an incomplete UTF-8 sequence that later bytes may complete), and
  - does not end in a byte-fallback token `<0xNN>` (skipped special tokens aside): the ByteFallback
    decoder turns a whole run of byte tokens into U+FFFDs if the run is invalid, so a run must be
    decoded in one piece.
Otherwise the text is held and the window grows. At finish everything is flushed.

A tokenizer with `clean_up_tokenization_spaces` (Llama 3's tokenizer_config sets it) has its text
cleaned (" ." -> ".", " 's" -> "'s", ...). Cleaning a window is not cleaning the whole text: a space
sent before a window boundary cannot be taken back when "." arrives after it, and the windowed
differences even lose characters ("I 'm here" streamed one token at a time came out "I ' here").
So the windows decode the raw text, and the committed raw text goes through `CleanUpStream`, which
sends the cleaned text only up to a point no clean-up pattern can span and holds the rest.

Two paths run these rules. The window rules above, minus the byte-fallback one, are exactly what
`tokenizers.decoders.DecodeStream` (Rust) does per request: it keeps the same window, decodes it and
the committed part, and returns the difference when it is non-empty and does not end in U+FFFD. One
call per request per step through it, with the window mirrored here, costs ~1.3 us a token against
~1.8 for the batched Python path (the call alone ~0.6; bench/detokenizer_bench.py, SmolLM2's
tokenizer), so a request runs on a DecodeStream when it can, and on the batched Python path
(`_decode_group`) when
  - the tokenizer's decoder has ByteFallback (DecodeStream would commit a valid start of a byte run
    that a later byte turns into U+FFFDs: its next decode no longer starts with what was sent),
  - the window passes MAX_WINDOW while held (DecodeStream has no cap: it would hold garbage output
    to the end and decode an ever longer window each step),
  - DecodeStream reports that a window's text does not start with the committed text (a decoder
    whose output is not prefix-stable; the Python path does what it always did there), or
  - the request finishes with text held (DecodeStream has no flush).
The first is per tokenizer; the others move one request to the Python path for good (the flush for
its last step only), which is exact because DecodeState mirrors the stream's window (`ids`, `read`)
as it goes: the Python path takes over where the stream stopped.

Under these rules concatenated deltas equal `TextTokenizer.decode(all ids)`; the property tests in
tests/detokenizer/test_decode_state.py check it for byte-level and byte-fallback tokenizers on both
paths, and tests/detokenizer/test_real_tokenizers.py for real ones (Qwen3, Llama 3, Llama 2, Gemma 3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

from tokenizers.decoders import DecodeStream

from ringserve.text_tokenizer import CLEANUP_RULES, TextTokenizer, clean_up

REPLACEMENT = "\ufffd"
# A window that keeps ending in U+FFFD (invalid UTF-8, i.e. garbage output) is committed anyway
# past this many ids, so decode work per step stays bounded. Below it, no U+FFFD is ever sent early.
MAX_WINDOW = 256
_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")

# The last characters of the patterns' proper prefixes (" ", " n", " n'", " '", " 'v", " 'r").
_CLEANUP_OPEN = frozenset(p[k - 1] for p, _ in CLEANUP_RULES for k in range(1, len(p)))


def _cleanup_safe_end(text: str) -> bool:
    """Can nothing that follows `text` change how it is cleaned? True when, at every rule's turn,
    no suffix of the partly cleaned text is a proper prefix of that rule's pattern: then no pattern
    occurrence spans the end, and clean_up(text + rest) == clean_up(text) + clean_up(rest)."""
    for pattern, repl in CLEANUP_RULES:
        if any(text.endswith(pattern[:k]) for k in range(1, len(pattern))):
            return False
        text = text.replace(pattern, repl)
    return True


class CleanUpStream:
    """clean_up over text that arrives in pieces: the concatenated outputs equal clean_up of the
    concatenated inputs. Each piece is sent cleaned up to a safe cut, the rest held for the next one."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> str:
        buf = self.held + text
        cut = len(buf)
        if not _cleanup_safe_end(buf):
            # After a character that ends no pattern prefix (never a space, so never deleted) the cut
            # is safe whatever came before it: back off to the last one.
            while cut and buf[cut - 1] in _CLEANUP_OPEN:
                cut -= 1
        self.held = buf[cut:]
        return clean_up(buf[:cut])

    def finish(self, text: str) -> str:
        buf, self.held = self.held + text, ""
        return clean_up(buf)


@dataclass(slots=True)
class DecodeState:
    """Decode window of one request (output ids only; the prompt is never decoded)."""

    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)  # output ids from the surrogate offset on
    read: int = 0  # ids[:read] are already turned into committed text
    surr_text: str | None = ""  # decode(ids[:read]), None when it must be decoded again
    cleanup: CleanUpStream | None = None  # tokenizers with clean_up_tokenization_spaces only
    # The Rust fast path (see the module docstring); None: the batched Python path decodes this request.
    stream: DecodeStream | None = None
    fed: int = 0  # ids[:fed] were given to `stream` (stream path only)

    def append(self, ids: list[int]) -> None:
        self.ids.extend(ids)


class DecodeJob(NamedTuple):
    state: DecodeState
    final: bool  # flush everything: the request finished


def byte_fallback_ids(tok: TextTokenizer) -> frozenset[int]:
    """Ids of `<0xNN>` tokens when the decoder has ByteFallback (else none)."""
    # The decoder's own JSON (microseconds); the whole tokenizer's (to_str + json.loads) took ~0.3 s a
    # Detokenizer for the default model.
    decoder = tok.tokenizer.decoder
    if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
        return frozenset()
    vocab = tok.tokenizer.get_vocab(with_added_tokens=False)
    return frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.match(t))


class IncrementalDecoder:
    """Turns the new ids of many requests into new text: one DecodeStream call per request, or, on
    the Python path, two batched decode calls per skip_special_tokens value."""

    def __init__(self, tokenizer: TextTokenizer, use_stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.hold_ids = byte_fallback_ids(tokenizer)
        self.special_ids = tokenizer.special_ids
        # Windows are decoded raw (TextTokenizer.decode_batch would clean each window on its own);
        # clean-up, where the tokenizer asks for it, runs on the committed text (CleanUpStream).
        self.cleans_up = tokenizer.clean_up_tokenization_spaces
        self._tok = tokenizer.tokenizer
        self._decode_batch = tokenizer.tokenizer.decode_batch
        # DecodeStream cannot hold byte-fallback runs (module docstring); use_stream=False is for
        # the bench and the tests, which compare the two paths.
        self.use_stream = use_stream and not self.hold_ids

    def new_state(self, skip_special_tokens: bool) -> DecodeState:
        """A request's empty state, on the stream path when this tokenizer allows it."""
        return DecodeState(skip_special_tokens=skip_special_tokens,
                           stream=DecodeStream(skip_special_tokens=skip_special_tokens)
                           if self.use_stream else None)

    def step(self, jobs: list[DecodeJob]) -> list[str]:
        """New committed text for each job, in order."""
        out = [""] * len(jobs)
        batched: list[int] = []
        for k, job in enumerate(jobs):
            if job.state.stream is None or (text := self._stream_step(job)) is None:
                batched.append(k)
            else:
                out[k] = self._clean(job, text) if self.cleans_up else text
        if batched:
            for skip in (True, False):
                idx = [i for i in batched if jobs[i].state.skip_special_tokens is skip]
                if idx:
                    self._decode_group([jobs[i] for i in idx], skip, out, idx)
        return out

    def _stream_step(self, job: DecodeJob) -> str | None:
        """The raw text the stream commits, or None: the batched Python path takes this job (and,
        unless it only flushes a finish, the request) over from the window mirrored in the state."""
        st = job.state
        stream = st.stream
        assert stream is not None
        ids = st.ids
        text: str | None = None
        if len(ids) > st.fed:
            new = ids[st.fed] if len(ids) == st.fed + 1 else ids[st.fed:]
            try:
                text = stream.step(self._tok, new)
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception for InvalidPrefix
                st.stream, st.surr_text = None, None
                return None
            st.fed = len(ids)
        if text is not None:
            # The stream committed everything it holds: mirror its window slide.
            if job.final:
                st.ids, st.read, st.fed, st.surr_text = [], 0, 0, ""
            else:
                del ids[:st.read]
                st.read = st.fed = len(ids)
            return text
        if len(ids) == st.read:  # nothing held (no new ids, or all of them were committed before)
            return ""
        if job.final or len(ids) > MAX_WINDOW:
            st.surr_text = None  # decode(ids[:read]) is the stream's prefix; the Python path redoes it
            if not job.final:
                st.stream = None
            return None
        return ""

    def _clean(self, job: DecodeJob, text: str) -> str:
        st = job.state
        st.cleanup = st.cleanup or CleanUpStream()
        return st.cleanup.finish(text) if job.final else st.cleanup.feed(text)

    def _decode_group(self, jobs: list[DecodeJob], skip: bool, out: list[str], idx: list[int]) -> None:
        full = self._decode_batch([j.state.ids for j in jobs], skip_special_tokens=skip)
        need = [k for k, j in enumerate(jobs) if j.state.surr_text is None]
        if need:
            surr = self._decode_batch([jobs[k].state.ids[:jobs[k].state.read] for k in need],
                                      skip_special_tokens=skip)
            for k, text in zip(need, surr):
                jobs[k].state.surr_text = text
        for k, job in enumerate(jobs):
            text = self._commit(job, full[k])
            out[idx[k]] = self._clean(job, text) if self.cleans_up else text

    def _commit(self, job: DecodeJob, full: str) -> str:
        """The new raw text the window commits (all of it when final)."""
        st = job.state
        prev = st.surr_text or ""
        new = full[len(prev):]
        if job.final:
            st.ids, st.read, st.surr_text = [], 0, ""
            return new
        if not new:
            return ""
        incomplete = new[-1] == REPLACEMENT or (bool(self.hold_ids) and self._ends_in_byte_run(st))
        if incomplete and len(st.ids) <= MAX_WINDOW:
            return ""
        # Slide the window: what was read becomes the surrogate context for the next decode.
        del st.ids[:st.read]
        st.read = len(st.ids)
        st.surr_text = None
        return new

    def _ends_in_byte_run(self, st: DecodeState) -> bool:
        """Is the last id the decoder sees a byte-fallback token? Skipped special tokens are
        removed before decoding, so they do not end a run of byte tokens."""
        for i in reversed(st.ids):
            if st.skip_special_tokens and i in self.special_ids:
                continue
            return i in self.hold_ids
        return False
