"""Stop strings on the text side: hold back what could start a stop, cut at the match on finish.

The scheduler decides the finish (it checks stop strings after every token and reports
`matched_str` in the same step that completed it); this only makes sure the client never sees
text at or past a stop:
  - while running, the longest suffix of the unsent text that is a proper prefix of some stop
    string is held back (a stop may span several tokens and steps);
  - a complete stop string that arrives without a finish was deliberately not a stop (e.g. before
    min_new_tokens), so it is released;
  - on a `matched_str` finish the unsent text is cut at the first occurrence of the matched string
    (keeping it when no_stop_trim); on any other finish everything held is released.
stop_regex patterns (ringserve/stop_regex.py) take the same path with two differences: `re` cannot say
whether a text could still grow into a match, so while running the last `span` characters (the
longest text a pattern can match, capped at stop_regex.LOOKBACK_CHARS) are held back whatever they
are; and a pattern's finish carries `trim_chars`, how much to cut from the end of the output text
(the scheduler ran the pattern; no pattern runs here).
"""

from __future__ import annotations

import logging

from ringserve import stop_regex

log = logging.getLogger(__name__)


def held_suffix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `stops`."""
    if not text:
        return 0
    last, best = text[-1], 0
    for stop in stops:
        # Longest candidates first; a prefix can only match if it ends in the text's last character
        # (a cheap index test before the slice and compare).
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if stop[k - 1] == last and text.endswith(stop[:k]):
                best = k
                break
    return best


class StopTrimmer:
    """Per-request text gate for stop strings and stop_regex patterns."""

    __slots__ = ("stops", "patterns", "pattern_hold", "no_stop_trim", "held")

    def __init__(self, stops: tuple[str, ...], no_stop_trim: bool, patterns: tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.patterns = patterns
        self.pattern_hold = stop_regex.max_span(patterns)  # characters held back for the patterns
        self.no_stop_trim = no_stop_trim
        self.held = ""

    def feed(self, text: str) -> str:
        """Text that can be sent now, given new committed text of a running request."""
        if not self.stops and not self.pattern_hold:
            return text
        buf = self.held + text
        keep = max(held_suffix_len(buf, self.stops), min(len(buf), self.pattern_hold))
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self, text: str, matched_str: str | None, rid: str = "", trim_chars: int | None = None) -> str:
        """The rest of the text at finish: cut at the matched stop string, or `trim_chars` from the end
        for a stop_regex finish."""
        buf = self.held + text
        self.held = ""
        if trim_chars is not None:
            if trim_chars > len(buf):  # a match longer than what was held: its start went out already
                log.warning("rid=%s stop_regex match starts in text already sent; cut what is unsent", rid)
            return buf[:max(0, len(buf) - trim_chars)]
        if not matched_str:
            return buf
        cut = buf.find(matched_str)
        if cut < 0:
            # The scheduler saw the stop in its own decode of the tail; if the text here lacks it
            # (e.g. it was released earlier as a non-stop), send what is left untrimmed.
            log.warning("rid=%s matched stop string %r not in unsent text; not trimmed", rid, matched_str)
            return buf
        return buf[:cut + len(matched_str)] if self.no_stop_trim else buf[:cut]
